"""``recommend.verify=K``: run the top K recommendations and a DDP baseline as cells of this machine, one sweep
directory and its report, and say whether the measured order agrees with the predicted one
(``zeroexp.recommend.verify``; docs/planner.md, Recommend).

Each cell is ``python -m zeroexp <overrides>`` in a fresh interpreter, its directory ``<verify_dir>/NN``; a cell
whose ``manifest.json`` says ok is not run again (the same ``recommend.verify_dir`` resumes). The cells use one
calibration of this machine at the verify's world size whose compute was timed on the cells' model (its
``compute.model_config``): the recommender's own (``network=this_machine``) when it is or was named
(``network.calibration=PATH``: the user's choice, each cell's ``plan.time`` then names the model it was timed on),
else the newest such of this machine (``outputs/calibration/``), else the one this verify made (resumed), else one
made first on that model and micro-batch (``python -m zeroexp.calibrate world_size=N model=... model.*=...
batch_size=...``, into ``<verify_dir>/calibration``): a compute rate carried over
from another model is not this model's (an MLP's made a GPT's cells predicted 3.6-7.9x low).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig

from zeroexp.errors import ConfigError
from zeroexp.results.format import fmt_ms

__all__ = ["Settings", "settings", "verify", "render"]

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Settings:
    k: int
    world_size: int
    model: list[str] | None  # the model's overrides of the cells; None: the recommended model
    steps: int
    batch_size: int | None
    out_dir: Path
    rounds: int = 1


def _int(value: Any, key: str, low: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(key, value, what)
    return value


def settings(cfg: DictConfig) -> Settings | None:
    """The verify's keys, checked before any work (:class:`ConfigError` naming the key); None: no verify."""
    r = cfg.recommend
    if r.verify is None or r.verify == 0:
        return None
    k = _int(r.verify, "recommend.verify", 1, "null (no verify) or an integer >= 1: the top K recommendations run")
    n = r.verify_world_size
    if n is None:
        n = 2
    n = _int(n, "recommend.verify_world_size", 2, "null (2) or an integer >= 2: the ranks of the cells here")
    if n > (os.cpu_count() or 1) * 4:
        raise ConfigError("recommend.verify_world_size", n, f"at most {4 * (os.cpu_count() or 1)} (4 ranks a core "
                          "here)")
    model = r.verify_model
    if model is not None:
        items = [str(m) for m in model] if isinstance(model, (list, tuple, ListConfig)) else [f"model={model}"]
        from zeroexp.recommend.space import CONF_DIR

        options = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        heads = [m for m in items if m.startswith("model=")]
        bad = [m for m in items if not (m.startswith("model=") or m.startswith("model."))]
        if bad or len(heads) != 1 or heads[0].split("=", 1)[1] not in options:
            raise ConfigError("recommend.verify_model", model, f"null (the recommended model), a model option "
                              f"({', '.join(options)}), or a list of model overrides: ['model=gpt','model.n_layer=2']")
        model = items
    steps = _int(r.verify_steps, "recommend.verify_steps", 9, "an integer >= 9: the optimizer steps of each cell "
                 "(3 warm-up and 4 probe steps are not timed; 20 gives 13 timed steps)")
    batch = None if r.verify_batch_size is None else _int(
        r.verify_batch_size, "recommend.verify_batch_size", 1, "null (the recommended micro-batch) or an integer >= 1")
    out = Path(str(r.verify_dir)) if r.verify_dir is not None else \
        Path("outputs/recommend") / time.strftime("%Y-%m-%d_%H-%M-%S", time.gmtime())
    if out.exists() and not out.is_dir():
        raise ConfigError("recommend.verify_dir", str(out), "null (a new directory) or a directory")
    rounds = _int(r.verify_rounds, "recommend.verify_rounds", 1, "an integer >= 1: how many times each cell runs, "
                  "one round of every cell after another")
    return Settings(k, n, model, steps, batch, out.resolve(), rounds)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _model_of(overrides: list[str]) -> tuple[list[str], dict[str, Any] | None]:
    """The cells' model: its overrides (``model=...``, ``model.*``, and ``batch_size``, the micro-batch the compute is
    timed at) and its config as its option's file and those overrides give it (the schema's defaults left out: they
    are the same in a calibration's), resolved; None when no ``model=`` option is named."""
    from omegaconf import OmegaConf

    from zeroexp.recommend.space import CONF_DIR

    items = [o for o in overrides if o.split("=", 1)[0] == "model" or o.startswith("model.") or
             o.startswith("batch_size=")]
    head = [o.split("=", 1)[1] for o in items if o.split("=", 1)[0] == "model"]
    if len(head) != 1 or not (CONF_DIR / "model" / f"{head[0]}.yaml").is_file():
        return items, None
    model = OmegaConf.load(CONF_DIR / "model" / f"{head[0]}.yaml")
    model.pop("defaults", None)
    tree = OmegaConf.merge({"model": model}, OmegaConf.from_dotlist([o for o in items if o.startswith("model.")]))
    return items, OmegaConf.to_container(tree, resolve=True)["model"]


def _same_model(cal: Any, config: dict[str, Any] | None, batches: set[int] = frozenset()) -> bool:
    """Whether ``cal``'s compute was timed on the model ``config`` (every key of it equal in the calibration's
    ``compute.model_config``; a calibration that does not record it: no) in a way that times the micro-batches
    ``batches`` (the cells' ``batch_size`` values; empty: they set none): fitted over two sizes
    (:func:`~zeroexp.results.calibration.call_cost_fitted`), or timed at the one size they all have."""
    from zeroexp.results.calibration import call_cost_fitted

    compute = cal.data["compute"]
    got = compute.get("model_config")
    return (config is not None and got is not None and all(got.get(k) == v for k, v in config.items())
            and (not batches or call_cost_fitted(compute) or batches == {compute.get("batch_size")}))


def calibration_for(cfg: DictConfig, s: Settings, cells: list[list[str]], say: Any) -> str:
    """The calibration the cells (their overrides) use (see the module's docstring): one of that size named or timed
    on the cells' model, else one made first on it at their largest micro-batch."""
    from zeroexp.results.calibration import calibration_directory, find_calibration, load_calibration

    items, config = _model_of(cells[0])
    items = [o for o in items if not o.startswith("batch_size=")]
    batches = {int(o.split("=", 1)[1]) for c in cells for o in c if o.startswith("batch_size=")}
    if batches:
        items.append(f"batch_size={max(batches)}")
    net = cfg.network
    if net.get("kind") == "calibration":
        path = net.get("calibration")
        cal = load_calibration(path) if path else find_calibration("gloo", s.world_size)
        if cal is not None and cal.world_size == s.world_size and (path or _same_model(cal, config, batches)):
            return str(Path(cal.path).resolve())  # one named (network.calibration=PATH) is the user's choice
    out = s.out_dir / "calibration"  # where this verify makes one: an earlier run of it made it (resumed)
    for directory in (calibration_directory(), out):
        found = find_calibration("gloo", s.world_size, directory, model=lambda c: _same_model(c, config, batches))
        if found is not None:
            return str(Path(found.path).resolve())
    args = [sys.executable, "-m", "zeroexp.calibrate", f"world_size={s.world_size}", *items, f"output_dir={out}"]
    say(f"no calibration of this machine at N={s.world_size} on the cells' model: making one first "
        f"({' '.join(args[1:])})")
    done = subprocess.run(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"python -m zeroexp.calibrate failed ({done.returncode}): {done.stdout[-2000:]}")
    return str(Path([line for line in done.stdout.splitlines() if line.endswith(".json")][-1]).resolve())


def plan_cells(recs: list[dict[str, Any]], s: Settings) -> list[dict[str, Any]]:
    """The cells: each of the top K recommendations mapped to this machine, then the DDP baseline (unless a mapped
    recommendation is it already); a recommendation with no cell here carries ``why``."""
    from zeroexp.recommend.verify import MappingRefused, baseline, map_overrides

    cells = []
    for i, r in enumerate(recs, 1):
        try:
            o, why = map_overrides(r["overrides"], s.world_size, s.model, s.batch_size), None
        except MappingRefused as e:
            o, why = None, str(e)
        cells.append({"label": f"#{i} {r['config']}", "rec": r, "overrides": o, "why": why})
    if recs:
        base = map_overrides(baseline(recs[0]["overrides"]), s.world_size, s.model, s.batch_size)
        if not any(c["overrides"] is not None and sorted(c["overrides"]) == sorted(base) for c in cells):
            cells.append({"label": "baseline ddp", "rec": None, "overrides": base, "why": None})
    return cells


def _run_cell(j: int, cell: dict[str, Any], common: list[str], s: Settings, say: Any, rnd: int = 1
              ) -> tuple[Path, str, str | None]:
    """Run one cell in round ``rnd`` (not again when its manifest says ok); (its directory, status, why). Round 1's
    cells are the verify directory's own (its sweep report's), round r's in ``rounds/<r>/``."""
    import json

    base = s.out_dir if rnd == 1 else s.out_dir / "rounds" / str(rnd)
    d = base / f"{j:02d}"
    of = f" (round {rnd} of {s.rounds})" if s.rounds > 1 else ""
    manifest = d / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("status") == "ok":
        say(f"cell {cell['label']}{of}: ok in {d} already (not run again)")
        return d, "ok", None
    args = [sys.executable, "-m", "zeroexp", *cell["overrides"], *common, f"hydra.run.dir={d}"]
    log = s.out_dir / "logs" / (f"{j:02d}.txt" if rnd == 1 else f"{j:02d}.r{rnd}.txt")
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(args, env=_env(), stdout=f, stderr=subprocess.STDOUT).returncode
    status = json.loads(manifest.read_text()).get("status", "failed") if manifest.is_file() else "failed"
    say(f"cell {cell['label']}{of}: {status} (exit {rc}, {time.perf_counter() - t0:.0f} s; log {log})")
    return d, status, None if status == "ok" else f"exit {rc}; its log: {log}"


def verify(cfg: DictConfig, answer: dict[str, Any], s: Settings, say: Any) -> dict[str, Any]:
    """Run the cells and the report; the JSON's ``verify`` (docs/results.md)."""
    import json

    from zeroexp.recommend.verify import cell_record, combine_rounds, pair_order

    cells = plan_cells(answer["recommendations"][:s.k], s)
    if not cells:
        return {"world_size": s.world_size, "rounds": s.rounds, "cells": [], "pairs_compared": 0, "pairs_separable": [],
                "pairs_tied": [], "pairs_flipped": [], "tie_tolerance": answer["tie_tolerance"], "kendall_tau": None,
                "report": None, "calibration": None,
                "why": "no configuration fits: nothing to run"}
    s.out_dir.mkdir(parents=True, exist_ok=True)
    calibration = calibration_for(cfg, s, [c["overrides"] for c in cells if c["overrides"] is not None], say)
    common = [f"steps={s.steps}", "logger=none", f"calibration={calibration}"]
    say(f"verify: {sum(c['overrides'] is not None for c in cells)} cells at N={s.world_size} on this machine, "
        f"calibration {calibration}, into {s.out_dir}:")
    for c in cells:
        say(f"  {c['label']}: " + (f"python -m zeroexp {' '.join(c['overrides'] + common)}" if c["overrides"]
                                   else f"not run: {c['why']}"))
    runs: dict[int, list[tuple[Path, str, str | None, dict[str, Any] | None]]] = {}
    for rnd in range(1, s.rounds + 1):  # every cell once, then again: a drift of the host reaches each cell alike
        for j, c in enumerate(cells):
            if c["overrides"] is not None:
                d, status, why = _run_cell(j, c, common, s, say, rnd)
                summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else None
                runs.setdefault(j, []).append((d, status, why, summary))
    records = []
    for j, c in enumerate(cells):
        if c["overrides"] is None:
            records.append(cell_record(c["label"], c["rec"], [], None, None, "not run", c["why"]))
            continue
        records.append(combine_rounds([cell_record(c["label"], c["rec"], c["overrides"] + common, d, summary,
                                                   status, why) for d, status, why, summary in runs[j]]))
    report = None
    if any(s.out_dir.glob("*/manifest.json")):
        from zeroexp.report import write_report

        write_report(s.out_dir, wandb_mode="none")
        report = str(s.out_dir / "report.md")
    return {"world_size": s.world_size, "rounds": s.rounds, "calibration": calibration, "cells": records,
            **pair_order([r for r in records if r["status"] == "ok"], answer["tie_tolerance"]), "report": report,
            "why": None}


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 2 ** 20:.1f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else fmt_ms(x)  # a small model's GPU step (0.024 ms) is not 0.0


def render(v: dict[str, Any], console: Any) -> None:
    """The verify as a table of 100 columns: per cell the recommendation's step, the step predicted on this machine
    beside the measured median and its CI, the peak predicted beside measured; then the order."""
    from rich.table import Table

    if v.get("why"):
        console.print(f"verify: {v['why']}")
        return
    table = Table(title=f"Verify: planned vs measured, N={v['world_size']} on this machine", width=100,
                  pad_edge=False)
    rounds = v.get("rounds", 1)
    interval = "95 % CI" if rounds == 1 else f"{rounds} runs' CIs"
    for name in ("cell", "rec. ms", "pred. ms", f"measured ms [{interval}]", "pred. MiB", "meas. MiB", "status"):
        table.add_column(name, justify="left" if name in ("cell", "status") else "right", overflow="fold")
    for c in v["cells"]:
        ci = c["median_ci95_ms"]
        meas = "-" if c["measured_median_ms"] is None else (
            f"{c['measured_median_ms']:.1f}" + (f" [{ci[0]:.1f}, {ci[1]:.1f}]" if ci else ""))
        table.add_row(c["cell"], _ms(c["recommended_step_ms"]), _ms(c["predicted_step_ms"]), meas,
                      _mb(c["predicted_peak_bytes"]), _mb(c["measured_peak_bytes"]),
                      c["status"] + (f": {c['why']}" if c["why"] else ""))
    console.print(table)
    sep, flip, tied = v["pairs_separable"], v["pairs_flipped"], v["pairs_tied"]
    tau = "n/a (no pair separable)" if v["kendall_tau"] is None else f"{v['kendall_tau']:.2f}"
    apart = "measured 95 % CIs apart" if rounds == 1 else f"the hulls of their {rounds} runs' 95 % CIs apart"
    console.print(f"order: {len(sep)} of {v['pairs_compared']} pairs separable ({apart}); "
                  f"{len(sep) - len(flip) - len(tied)} ordered as predicted, {len(tied)} predicted to tie (within "
                  f"{100 * v['tie_tolerance']:.0f} %), {len(flip)} flipped; Kendall's tau over them {tau}"
                  + (f"; flipped: {', '.join(flip)}" if flip else ""), overflow="fold")
    console.print("rec. ms: the recommendation's step (its network); pred.: computed for the cell on this "
                  f"machine's calibration ({v['calibration']}); measured: the cell's timed steps and peak"
                  + ("" if rounds == 1 else f" (the median of its {rounds} runs' medians; each run in the JSON's "
                                            "cells[].rounds)"), overflow="fold")
    console.print(f"report: {v['report']}", overflow="fold")
