"""``python -m zeroexp.calibrate``: Hydra-configured (``conf/calibrate.yaml``); spawns ``world_size`` ranks on
loopback, measures (:mod:`zeroexp.calibrate.measure`), fits each op's latency and bus bandwidth
(:func:`zeroexp.formulas.fit_link`), writes ``<output_dir>/<time>_<backend>_n<N>.json`` (``output_dir`` null, the
default: ``$ZEROEXP_CALIBRATION_DIR`` or ``outputs/calibration``) and a PNG of busbw against size beside it, and prints
a table.

Exit codes: 0 calibrated; 2 bad input (a key and what it accepts); 1 a rank failed.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from zeroexp.results.calibration import SCHEMA, calibration_directory, load_calibration, machine
from zeroexp.errors import ConfigError
from zeroexp.formulas import CALIBRATED_OPS, fit_link, overlap_possible

__all__ = ["CalibrateConfig", "main", "run"]

_STARTED = False


@dataclass
class SweepConfig:
    """The message sizes (nccl-tests' -b / -e / -f 2) and the calls timed per size (``iters`` x ``repeats``, each
    alone from a barrier)."""

    min_bytes: int = 4096
    max_bytes: int = 256 * 2**20
    ops: List[str] = field(default_factory=lambda: list(CALIBRATED_OPS))
    min_iters: int = 2
    max_iters: int = 50
    target_s: float = 0.1
    repeats: int = 3
    compute_steps: int = 30
    wake_gaps_ms: List[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
    wake_bytes: int = 65536
    wake_calls: int = 120


@dataclass
class CalibrateConfig:
    model: Any = MISSING
    world_size: int = 2
    batch_size: int = 8
    device: str = "auto"
    output_dir: Optional[str] = None  # None: zeroexp.results.calibration.calibration_directory()
    calibrate: SweepConfig = field(default_factory=SweepConfig)


def register() -> None:
    from zeroexp.config.schemas import register_schemas

    register_schemas()
    ConfigStore.instance().store(name="calibrate_schema", node=CalibrateConfig)


def validate(cfg: DictConfig) -> None:
    """Refuse bad input before any rank starts, naming the key."""
    from zeroexp.config.known_keys import check_known_keys

    check_known_keys(cfg, CalibrateConfig)
    c = cfg.calibrate
    for key in ("world_size", "batch_size", "calibrate.min_bytes", "calibrate.max_bytes", "calibrate.min_iters",
                "calibrate.max_iters", "calibrate.repeats", "calibrate.compute_steps", "calibrate.wake_bytes",
                "calibrate.wake_calls"):
        v = OmegaConf.select(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(key, v, "an integer >= 1")
    if c.min_bytes > c.max_bytes:
        raise ConfigError("calibrate.max_bytes", c.max_bytes, f"bytes >= calibrate.min_bytes = {c.min_bytes}")
    if c.min_bytes < 4 * cfg.world_size:
        raise ConfigError("calibrate.min_bytes", c.min_bytes, f"bytes >= 4 x world_size = {4 * cfg.world_size} "
                                                             "(one fp32 element per rank)")
    if c.min_iters > c.max_iters:
        raise ConfigError("calibrate.max_iters", c.max_iters, f"an integer >= calibrate.min_iters = {c.min_iters}")
    bad = [op for op in c.ops if op not in CALIBRATED_OPS]
    if bad or not c.ops:
        raise ConfigError("calibrate.ops", list(c.ops), f"a non-empty list of {', '.join(CALIBRATED_OPS)}")
    gaps = list(c.wake_gaps_ms)
    if (not gaps or gaps[0] != 0 or any(isinstance(g, bool) or not isinstance(g, (int, float)) for g in gaps)
            or any(b <= a for a, b in zip(gaps, gaps[1:]))):
        raise ConfigError("calibrate.wake_gaps_ms", gaps, "increasing milliseconds of compute starting at 0 "
                                                          "(the call from a synchronized start the others are less)")
    if not c.target_s > 0:
        raise ConfigError("calibrate.target_s", c.target_s, "seconds > 0")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("device", cfg.device, "auto, cpu, cuda")
    if cfg.device == "cuda":
        from zeroexp.devices import ranks_get_a_gpu

        if not ranks_get_a_gpu({"device": "auto", "world_size": cfg.world_size}, local=cfg.world_size):
            raise ConfigError("device", "cuda", "cpu or auto", why=f"no GPU for each of world_size={cfg.world_size} "
                                                                   "ranks (NCCL cannot put two ranks on one GPU)")


def run(cfg: DictConfig) -> Path:
    """Validate, measure on ``world_size`` ranks, fit, write the calibration JSON; returns its path."""
    from zeroexp.devices import ranks_get_a_gpu
    from zeroexp.launch.local import free_port, rank_context

    validate(cfg)
    n = int(cfg.world_size)
    on_gpu = ranks_get_a_gpu({"device": cfg.device, "world_size": n}, local=n)
    backend, device = ("nccl", "cuda") if on_gpu else ("gloo", "cpu")
    ctx = rank_context()  # the cells' forkserver: ranks end in os._exit (a spawned gloo rank can abort at teardown)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        port = free_port()
        plain = OmegaConf.to_container(cfg, resolve=True)
        procs = [ctx.Process(target=_rank_entry, args=(r, n, port, backend, device, plain, out)) for r in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"calibration ranks failed (rank, exit code): {failed}")
        measured = json.loads(Path(out).read_text())
    created = dt.datetime.now(dt.timezone.utc)
    host = machine()
    import torch

    collectives = {}
    for op, entry in measured["collectives"].items():
        rows = entry["sizes"]
        fit = fit_link(op, n, [r["bytes"] for r in rows], [r["seconds"] for r in rows])
        collectives[op] = {"sizes": rows, "cold_bytes": entry.get("cold_bytes"),
                           "fit": {"alpha_s": fit.alpha_s, "busbw_Bps": fit.busbw_Bps,
                                   "model": "t = alpha_s + S x bus_factor(op, N) / busbw_Bps"}}
    threads = int(measured["threads_per_rank"])
    overlap = overlap_possible(device, int(host["cores"]), n, threads)
    data = {
        "schema": SCHEMA, "created": created.isoformat(timespec="seconds"), "machine": host,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None},
        "backend": backend, "device": device, "world_size": n, "threads_per_rank": threads,
        "host_allocator": measured.get("host_allocator"), "host_activity": measured.get("host_activity"),
        "overlap": {"possible": overlap,
                    "why": "CUDA: collectives run on their own stream" if device == "cuda" else
                    f"{host['cores']} cores, {n} ranks x {threads} compute threads: "
                    + ("a core left per rank for gloo" if overlap else "no core left: gloo time-slices with compute")},
        "collectives": collectives, "wake": measured["wake"], "compute": measured["compute"],
        "framework": measured["framework"],
        "method": "each collective call timed alone from a barrier (the slowest rank's; median and 10 % trimmed mean "
                  "over calls, the model uses the mean: a step sums its calls); up to 32 MiB also in async bursts "
                  "of 8 and in streams of 8 sync calls one after another (a call's floor behind another); the wake "
                  "curve: the same call after a gap of compute (zeroexp.calibrate.measure)",
        "source": "measured: python -m zeroexp.calibrate",
        "settings": OmegaConf.to_container(cfg.calibrate, resolve=True),
    }
    directory = Path(cfg.output_dir) if cfg.output_dir else calibration_directory()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{created.strftime('%Y-%m-%d_%H-%M-%S')}_{backend}_n{n}.json"
    path.write_text(json.dumps(data, indent=1))
    load_calibration(path)  # the file reads back
    return path


def _rank_entry(*args: Any) -> None:
    from zeroexp.calibrate.measure import rank_main

    rank_main(*args)


def task(cfg: DictConfig) -> None:
    """Hydra's task: calibrate, print the table, write the plot, print the file's path last."""
    from rich.console import Console

    from zeroexp.calibrate.display import render_table, write_plot

    global _STARTED
    _STARTED = True
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    errors = Console(stderr=True, highlight=False)
    try:
        with errors.status(f"calibrating: {cfg.world_size} ranks, collectives {cfg.calibrate.min_bytes} B .. "
                           f"{cfg.calibrate.max_bytes} B, then {cfg.model.name}'s forward, backward, AdamW"):
            path = run(cfg)
    except ConfigError as e:
        errors.print(f"[red]error:[/] {e}")
        sys.exit(2)
    except RuntimeError as e:
        errors.print(f"[red]failed:[/] {e}")
        sys.exit(1)
    cal = load_calibration(path)
    render_table(cal, console)
    if cal.data["collectives"]:
        write_plot(cal, path.with_suffix(".png"))
        print(path.with_suffix(".png"))
    print(path)


def main() -> None:
    """``python -m zeroexp.calibrate``."""
    from zeroexp.cli.hydra_app import run_hydra_app

    register()
    run_hydra_app("calibrate", task, lambda: _STARTED)
