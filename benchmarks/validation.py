"""Published GPU runs laid beside zeroexp's predictions (docs/validation.md; issue 52 item 3).

Each run of docs/validation_runs.yaml is planned as it ran: its overrides composed on conf/plan.yaml and given to
``zeroexp.cli.plan.run`` (the planner's own path, as the tests call it); the planner's field that matches what the
run published (``reserved_peak_bytes``, ``peak_bytes``, ``device_total_bytes``, or ``tokens_per_s`` over
``world_size``) is printed beside the published figure with their ratio, and a line counts the figures within the
issue's bar. Runs that share a model and micro-batch trace it once (one invocation memo, zeroexp.cell.memo).

    python benchmarks/validation.py                          # the markdown blocks of docs/validation.md, printed
    python benchmarks/validation.py --write docs/validation.md   # ... written between the doc's markers

tests/test_validation.py recomputes every prediction and checks the figures the doc prints.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "docs" / "validation_runs.yaml"
GIB = 2**30
#: The issue's bar (a figure within it meets it) and goal: peak memory within 10 % (goal 5 %), tokens/s within 20 %
#: (goal 10 %).
BAR = {"memory": (0.10, 0.05), "tokens": (0.20, 0.10)}
#: The planner's fields a published figure can be laid beside, and which bar judges each.
FIELDS = {"reserved_peak_bytes": "memory", "peak_bytes": "memory", "device_total_bytes": "memory",
          "tokens_per_s_per_gpu": "tokens"}
#: Digits the table prints: the prediction by unit, and the ratio.
DIGITS = {"GiB": 2, "tok/s": 0}
RATIO_DIGITS = 3
MARKERS = ("summary", "table", "runs")


def load_runs(path: Path = RUNS) -> list[dict[str, Any]]:
    """The runs of the data file, each a dict (id, source, provenance, date, hardware, overrides, taken, published)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)["runs"]


def _hydra_compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="plan", overrides=list(overrides))


def predict(run: dict[str, Any], compose: Callable[[list[str]], Any] = _hydra_compose) -> dict[str, float]:
    """The planner's figures for ``run`` (its one record: ``strategy=`` names one row), by published field: bytes
    for memory fields, tokens a second a GPU for ``tokens_per_s_per_gpu``."""
    from zeroexp.cli.plan import register, run as plan

    register()
    records, _ = plan(compose(list(run["overrides"])))
    if len(records) != 1:
        raise ValueError(f"{run['id']}: {len(records)} rows planned; name one strategy")
    r = records[0]
    out = {}
    for pub in run["published"]:
        field = pub["field"]
        if field not in FIELDS:
            raise ValueError(f"{run['id']}: published field {field!r} is none of {sorted(FIELDS)}")
        out[field] = r["tokens_per_s"] / r["world_size"] if field == "tokens_per_s_per_gpu" else r[field]
    return out


def predict_all(runs: list[dict[str, Any]], compose: Callable[[list[str]], Any] = _hydra_compose
                ) -> dict[str, dict[str, float]]:
    """:func:`predict` of every run, in one invocation memo (a model's shape and traced step computed once)."""
    from zeroexp.cell.memo import invocation_memo

    with invocation_memo():
        return {run["id"]: predict(run, compose) for run in runs}


def shown(value: float, unit: str) -> float:
    """A prediction as the table prints it: GiB from bytes, rounded to :data:`DIGITS`."""
    return round(value / GIB if unit == "GiB" else value, DIGITS[unit])


def ratio(prediction: float, published: float, unit: str) -> float:
    """Prediction over the published figure, from the printed prediction, rounded as printed."""
    return round(shown(prediction, unit) / published, RATIO_DIGITS)


def rows(runs: list[dict[str, Any]], predictions: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """One row per published figure: id, field, prediction as printed, published, unit, ratio, kind, within bar."""
    out = []
    for run in runs:
        for pub in run["published"]:
            kind, unit = FIELDS[pub["field"]], pub["unit"]
            pred = predictions[run["id"]][pub["field"]]
            q = ratio(pred, pub["value"], unit)
            out.append({"id": run["id"], "source": run["source"], "field": pub["field"], "unit": unit,
                        "prediction": shown(pred, unit), "published": pub["value"], "ratio": q, "kind": kind,
                        "bar": abs(q - 1) <= BAR[kind][0], "goal": abs(q - 1) <= BAR[kind][1]})
    return out


def counts(table: list[dict[str, Any]]) -> dict[str, tuple[int, int, int]]:
    """By kind (memory, tokens): (figures within the bar, within the goal, figures)."""
    return {kind: (sum(r["bar"] for r in mine), sum(r["goal"] for r in mine), len(mine))
            for kind in BAR for mine in [[r for r in table if r["kind"] == kind]]}


def _num(value: float, digits: int) -> str:
    return f"{value:,.{digits}f}"


def summary_md(table: list[dict[str, Any]], runs: list[dict[str, Any]]) -> str:
    c = counts(table)
    (mb, mg, mn), (tb, tg, tn) = c["memory"], c["tokens"]
    sources = len({r["source"] for r in runs})
    return (f"Runs laid beside: {len(runs)} from {sources} sources, {mn + tn} published figures.\n"
            f"Peak memory: {mb} of {mn} within 10 % ({mg} within 5 %). "
            f"Tokens/s per GPU: {tb} of {tn} within 20 % ({tg} within 10 %).")


def table_md(table: list[dict[str, Any]]) -> str:
    head = ["| run | source | planner field | predicted | published | unit | predicted / published | bar |",
            "|---|---|---|---:|---:|---|---:|---|"]
    body = [f"| {r['id']} | {r['source']} | `{r['field']}` | {_num(r['prediction'], DIGITS[r['unit']])} | "
            f"{_num(r['published'], DIGITS[r['unit']] if r['unit'] != 'GiB' else 1)} | {r['unit']} | "
            f"{r['ratio']:.{RATIO_DIGITS}f} | {'goal' if r['goal'] else 'bar' if r['bar'] else 'miss'} |"
            for r in table]
    return "\n".join(head + body)


def runs_md(runs: list[dict[str, Any]]) -> str:
    """Each run's provenance, hardware, command and the settings taken where the source is uncertain."""
    out = []
    for run in runs:
        pubs = "; ".join(f"{p['value']:,} {p['unit']} ({p['metric']}) as `{p['field']}`" for p in run["published"])
        cmd = " ".join(f"'{o}'" if any(ch in o for ch in "[]") else o for o in run["overrides"])
        out += [f"**{run['id']}** ({run['source']}, {run['date']}). {run['provenance']}", "",
                f"- hardware: {run['hardware']}", f"- published: {pubs}",
                f"- plan: `python -m zeroexp.plan {cmd}`", f"- taken: {run['taken']}", ""]
    return "\n".join(out).rstrip()


def blocks(runs: list[dict[str, Any]], predictions: dict[str, dict[str, float]]) -> dict[str, str]:
    """The doc's generated blocks by marker name."""
    table = rows(runs, predictions)
    return {"summary": summary_md(table, runs), "table": table_md(table), "runs": runs_md(runs)}


def marked(text: str, name: str) -> str:
    """The block of ``text`` between ``<!-- validation:name -->`` and ``<!-- /validation:name -->``."""
    m = re.search(rf"<!-- validation:{name} -->\n(.*?)<!-- /validation:{name} -->", text, re.S)
    if m is None:
        raise ValueError(f"no <!-- validation:{name} --> block")
    return m.group(1).rstrip("\n")


def write(path: Path, generated: dict[str, str]) -> None:
    text = path.read_text()
    for name, block in generated.items():
        marked(text, name)  # present
        text = re.sub(rf"(<!-- validation:{name} -->\n).*?(<!-- /validation:{name} -->)",
                      lambda m: m.group(1) + block + "\n" + m.group(2), text, flags=re.S)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--write", type=Path, default=None, help="write the blocks between this doc's markers")
    args = parser.parse_args(argv)
    runs = load_runs(args.runs)
    generated = blocks(runs, predict_all(runs))
    if args.write:
        write(args.write, generated)
    for name in MARKERS:
        print(f"<!-- validation:{name} -->\n{generated[name]}\n<!-- /validation:{name} -->\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
