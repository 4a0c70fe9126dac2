"""A sweep's W&B *Report*: the shareable workspace document with panels over the cells' runs, built with
``wandb-workspaces`` (``pip install -e ".[wandb]"``; ``.[dev]`` has it).

``python -m zeroexp.report SWEEP_DIR --wandb-report`` builds it (:func:`build_wandb_report`: no network, no API
call) and then, when logged in (an API key in ``WANDB_API_KEY`` or ``~/.netrc``) and not offline
(``WANDB_MODE``), saves it and prints its URL (:func:`save_wandb_report`); offline it prints what it would create
(:func:`describe`) and the commands that create it once the runs are synced.

The report: the verdicts and what won as text, then one section per report table (the cells, each probe's, the
planner's, the failures when any), each with its table as Markdown and a panel grid over the sweep's cell runs (a run
set filtered to the sweep's group and ``job_type=cell``). The panels read the keys the cells really log
(``zeroexp.launch.wandb_cell``): ``train/loss_rank0`` per ``trainer/global_step``, and their ``summary.json`` flattened
with ``/`` (``state/max_rank_bytes/param``, ``collectives/counts/all_gather``, ``timing/median_ms``, ...).
"""

from __future__ import annotations

import netrc
import os
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pandas as pd

from zeroexp.results.cells import column
from zeroexp.results.format import missing
from zeroexp.results.section import CORE_KINDS, OPS

if TYPE_CHECKING:
    from zeroexp.report.model import Report

__all__ = ["LOSS_KEY", "STEP_KEY", "BARS", "report_target", "build_wandb_report", "describe", "logged_in",
           "save_wandb_report", "sync_commands"]

#: What every cell's W&B run logs per step: rank 0's loss and the step (zeroexp.launch.wandb_cell).
LOSS_KEY, STEP_KEY = "train/loss_rank0", "trainer/global_step"
#: Bar plots per report section (table key): (title, summary fields). A field ending in ``.`` stands for every
#: numeric field under it that some cell has, in :data:`_ORDER`, then by name; one with ``*`` for every numeric field
#: it matches (``fnmatch``), by name.
BARS: dict[str, list[tuple[str, list[str]]]] = {
    "cells": [("Final loss per cell", ["final_loss"])],
    "state": [("State bytes per cell, largest rank", ["state.max_rank_bytes."]),
              ("State factors (bytes / parameter bytes)", ["state.factors."])],
    "memory": [("Steady and peak bytes, largest rank", ["memory.steady_bytes_max", "memory.peak_bytes_max"]),
               ("Peak bytes per phase, largest rank", ["memory.phase_peak_bytes_max."])],
    "collectives": [("Calls per step, per op", ["collectives.counts."]),
                    ("Payload bytes per step, per op", ["collectives.payload_bytes."])],
    "collective_groups": [("Calls per step, per op and process group", ["collectives.groups.*.*.count"]),
                          ("Payload bytes per step, per op and process group",
                           ["collectives.groups.*.*.payload_bytes"])],
    "timing": [("Step time, ms (median, p95)", ["timing.median_ms", "timing.p95_ms"])],
    "equivalence": [("Max abs error vs the unsharded reference, and its bound",
                     ["equivalence.max_abs_err", "equivalence.effective_threshold"])],
    "plan": [("Planned vs measured state bytes, largest rank",
              ["plan.predicted_bytes.total", "plan.measured_bytes.total"])],
}
_ORDER = (*CORE_KINDS, *OPS, "forward", "backward", "optimizer")
_GRID_W, _PANEL_H = 24, 8  # a panel grid is 24 units wide: two panels a row


def _numeric(values: pd.Series) -> bool:
    found = [v for v in values if not missing(v)]
    return bool(found) and all(pd.api.types.is_number(v) and not pd.api.types.is_bool(v) for v in found)


def _fields(cells: pd.DataFrame, spec: list[str]) -> list[str]:
    """The summary fields of ``spec`` that some cell has, numeric, prefixes expanded."""
    out: list[str] = []
    for key in spec:
        if key.endswith("."):
            under = [c for c in cells.columns if c.startswith(key) and "." not in c[len(key):]]
            rank = {name: i for i, name in enumerate(_ORDER)}
            under.sort(key=lambda c: (rank.get(c[len(key):], len(rank)), c))
        elif "*" in key:
            under = sorted(c for c in cells.columns if fnmatchcase(c, key))
        else:
            under = [key] if key in cells.columns else []
        out += [c for c in under if c not in out and _numeric(cells[c])]
    return out


def _wandb_key(field: str) -> str:
    """A ``summary.json`` field (``state.max_rank_bytes.param``) as the cells' W&B summary key (``/``-joined)."""
    return field.replace(".", "/")


def report_target(cells: pd.DataFrame) -> dict[str, Any]:
    """``{"project", "entity", "group", "logged"}``: where the cells' runs are (their logger config; project
    ``zeroexp`` and your default entity when they did not log to W&B), the runs' group (the sweep's name) and
    whether any cell logged to W&B at all."""
    wandb_cells = cells[column(cells, "config.logger.name") == "wandb"]
    first = wandb_cells.iloc[0] if len(wandb_cells) else pd.Series(dtype=object)
    get = (lambda k, d=None: d if missing(first.get(k)) else first.get(k))
    groups = [g for g in column(cells, "sweep") if not missing(g)]
    return {"project": get("config.logger.project", "zeroexp"), "entity": get("config.logger.entity"),
            "group": str(groups[0]) if groups else None, "logged": bool(len(wandb_cells))}


def _runset(wr: Any, expr: Any, target: dict[str, Any], entity: str) -> Any:
    return wr.Runset(entity=entity, project=target["project"], name=f"cells of {target['group']}",
                     filters=expr.And(expr.Metric("Group") == target["group"], expr.Metric("JobType") == "cell"))


def _layout(wr: Any, i: int) -> Any:
    return wr.Layout(x=(i % 2) * _GRID_W // 2, y=(i // 2) * _PANEL_H, w=_GRID_W // 2, h=_PANEL_H)


def _panels(wr: Any, report: Report, key: str, raw: pd.DataFrame) -> list[Any]:
    """The panels of the section ``key``: its bar plots (:data:`BARS`; a section with none there plots the numeric
    summary fields of its table), and the loss per step in the cells' section."""
    cells = report.cells[report.cells.status == "ok"] if "status" in report.cells.columns else report.cells
    panels = []
    if key == "cells":
        panels.append(wr.LinePlot(title="Loss per step, rank 0, per cell", x=STEP_KEY, y=[LOSS_KEY],
                                  title_x="step", title_y="loss"))
    specs = BARS.get(key)
    if specs is None:  # a probe the report knows nothing of: its table's numeric summary fields
        specs = [(f"{key} per cell", [c for c in raw.columns if c not in ("label", "cell_name")])]
    for title, spec in specs:
        fields = _fields(cells, spec)
        if fields:
            panels.append(wr.BarPlot(title=title, metrics=[_wandb_key(f) for f in fields], orientation="v"))
    for i, panel in enumerate(panels):
        panel.layout = _layout(wr, i)
    return panels


def _verdicts_markdown(report: Report) -> str:
    lines = [f"- {line}" for line in report.verdicts.lines]
    failures = report.verdicts.failures
    lines += ["", "**Failures:**", "", *(f"- {f}" for f in failures)] if failures else ["", "**Failures:** none."]
    return "\n".join(lines)


def build_wandb_report(report: Report, project: str | None = None, entity: str | None = None) -> Any:
    """The W&B Report of ``report``'s sweep as a ``wandb_workspaces.reports.v2.Report``, not saved.

    ``project`` and ``entity`` default to the cells' logger config (:func:`report_target`); an entity of None is
    left empty (saving needs one: :func:`save_wandb_report` fills in your default entity). No API call is made.
    """
    import wandb_workspaces.reports.v2 as wr
    from wandb_workspaces import expr

    from zeroexp.report.pages import _md_table, winners_markdown

    target = report_target(report.cells)
    target["group"] = target["group"] or report.sweep_dir.name
    target["project"] = project or target["project"]
    entity = entity or target["entity"] or ""
    sweep = target["group"]
    blocks: list[Any] = [
        wr.P(f"{len(report.cells)} cells of the zeroexp sweep {sweep} ({report.sweep_dir}); generated "
             f"{report.generated_at}; {report.environment}. Every panel reads the cells' runs (group {sweep}, job "
             f"type cell); the sweep's own run report-{sweep} holds the HTML report, its tables and plots."),
        wr.TableOfContents(),
        wr.H2("Verdicts"),
        wr.MarkdownBlock(_verdicts_markdown(report)),
        wr.H2("What won"),
        wr.MarkdownBlock("\n".join(winners_markdown(report))),
    ]
    for table in report.tables:
        if table.key == "failures" and not len(table.raw):
            continue
        blocks += [wr.H2(table.title), wr.MarkdownBlock("\n".join(_md_table(table)))]
        if table.note:
            blocks.append(wr.P(table.note))
        panels = _panels(wr, report, table.key, table.raw)
        if panels:
            blocks.append(wr.PanelGrid(runsets=[_runset(wr, expr, target, entity)], panels=panels))
    return wr.Report(project=target["project"], entity=entity, title=f"zeroexp sweep {sweep}"[:128],
                     description=f"ZeRO/FSDP sharding sweep {sweep}: state, memory, collectives, timing, "
                                 "equivalence per cell", blocks=blocks, width="fluid")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "".join(str(v) for v in value)


def describe(wandb_report: Any) -> list[str]:
    """What ``wandb_report`` holds, as lines: its title and project, the run set, then each section's text and
    panels (title and metrics)."""
    import wandb_workspaces.reports.v2 as wr

    entity = wandb_report.entity or "<your default entity>"
    out = [f"W&B Report \"{wandb_report.title}\" in {entity}/{wandb_report.project}"]
    runsets = [g.runsets[0] for g in wandb_report.blocks if isinstance(g, wr.PanelGrid) and g.runsets]
    if runsets:
        out.append(f"  run set: {runsets[0].filters}")
    for block in wandb_report.blocks:
        if isinstance(block, wr.H2):
            out.append(f"  section: {_text(block.text)}")
        elif isinstance(block, wr.MarkdownBlock):
            out.append(f"    text: {len(block.text.splitlines())} lines of Markdown")
        elif isinstance(block, wr.PanelGrid):
            for p in block.panels:
                if isinstance(p, wr.LinePlot):
                    out.append(f"    line plot \"{p.title}\": {', '.join(map(str, p.y))} per {p.x}, one line per cell")
                elif isinstance(p, wr.BarPlot):
                    out.append(f"    bar plot \"{p.title}\": {', '.join(map(str, p.metrics))}, one bar per cell")
                else:
                    out.append(f"    {type(p).__name__} \"{getattr(p, 'title', '')}\"")
    return out


def _host() -> str:
    return urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"


def logged_in() -> bool:
    """An API key in ``WANDB_API_KEY`` or in the netrc file for the W&B host, and ``WANDB_MODE`` neither
    ``offline`` nor ``disabled``. Reads no network."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled") or \
            os.environ.get("WANDB_OFFLINE", "").lower() in ("1", "true"):
        return False
    if os.environ.get("WANDB_API_KEY"):
        return True
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        return path.is_file() and netrc.netrc(str(path)).authenticators(_host()) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def save_wandb_report(wandb_report: Any) -> str:
    """Save ``wandb_report`` to W&B (network) and return its URL; an empty entity becomes your default entity."""
    import wandb_workspaces.reports.v2 as wr

    if not wandb_report.entity:
        import wandb

        wandb_report.entity = wandb.Api().default_entity
        for grid in (b for b in wandb_report.blocks if isinstance(b, wr.PanelGrid)):
            for runset in grid.runsets:
                runset.entity = runset.entity or wandb_report.entity
    wandb_report.save()
    return wandb_report.url


def sync_commands(sweep_dir: Path) -> list[str]:
    """The commands that create the report from an offline sweep: log in, sync its runs, build it online."""
    return ["wandb login",
            f"wandb sync {sweep_dir}/*/wandb/offline-run-* {sweep_dir}/wandb/offline-run-*",
            f"python -m zeroexp.report {sweep_dir} --wandb-report"]
