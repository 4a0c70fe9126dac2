"""The report's PNG plots (matplotlib, Agg canvas, no pyplot state): one function per plot.

Each function takes the cells in ladder order (with ``label`` and ``cell_dir``) and the path to write, and
returns the path, or None when no cell has the data. Bytes use the same MiB/GiB choice as the tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory

from zeroexp.formulas import WORLD
from zeroexp.results.cells import column
from zeroexp.results.format import byte_unit, missing
from zeroexp.report.groups import groups_of
from zeroexp.report.plan_picture import KIND_COLOURS  # stacked kinds; every other kind is "other"
from zeroexp.results.section import OPS
from zeroexp.report.step_time import planned_vs_measured

__all__ = ["PLOTS", "state_bytes", "steady_vs_peak", "planned_peaks", "step_times", "collective_payload"]

OP_COLOURS = {"all_reduce": "#4C72B0", "broadcast": "#C44E52", "all_gather": "#55A868", "reduce_scatter": "#DD8452"}


def _figure(n_groups: int, title: str) -> tuple[Figure, object]:
    fig = Figure(figsize=(min(24.0, max(6.0, 1.15 * n_groups + 2)), 4.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    return fig, ax


def _read_csv(cell_dir: str, name: str) -> pd.DataFrame | None:
    path = Path(cell_dir) / name
    return pd.read_csv(path) if path.exists() else None


def state_bytes(cells: pd.DataFrame, path: Path) -> Path | None:
    """Per-rank stacked bars of the physical bytes of param, grad and optim (and master) for each cell."""
    ok = cells[column(cells, "status") == "ok"]
    frames = [(row["label"], _read_csv(row["cell_dir"], "rank_state.csv")) for _, row in ok.iterrows()]
    frames = [(label, f.assign(kind=f.kind.where(f.kind.isin(list(KIND_COLOURS)), "other")))
              for label, f in frames if f is not None and not f.empty]
    if not frames:
        return None
    kinds = [k for k in KIND_COLOURS if any(f[f.kind == k].physical_bytes.sum() > 0 for _, f in frames)]
    unit = byte_unit(f.groupby("rank").physical_bytes.sum().max() for _, f in frames)
    fig, ax = _figure(len(frames), f"State per rank at the optimizer boundary (physical {unit})")
    x, centres, ticks, tick_labels = 0.0, [], [], []
    for label, f in frames:
        ranks = sorted(f["rank"].unique())
        xs = [x + i for i in range(len(ranks))]
        bottom = [0.0] * len(ranks)
        for kind in kinds:
            sub = f[f.kind == kind].groupby("rank").physical_bytes.sum()
            heights = [unit.value(sub.get(r, 0)) for r in ranks]
            ax.bar(xs, heights, bottom=bottom, width=0.8, color=KIND_COLOURS[kind],
                   label=kind if label == frames[0][0] else None)
            bottom = [b + h for b, h in zip(bottom, heights)]
        centres.append((xs[0] + xs[-1]) / 2)
        if len(ranks) <= 8:
            ticks += xs
            tick_labels += [f"r{r}" for r in ranks]
        x = xs[-1] + 2
    ax.set_xticks(ticks, tick_labels, fontsize=7)
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    for c, (label, _) in zip(centres, frames):
        ax.text(c, -0.09, label, transform=trans, ha="center", va="top", fontsize=8)
    ax.set_ylabel(unit.name)
    ax.legend(fontsize=8)
    fig.savefig(path)
    return path


def _bars(cells: pd.DataFrame, series: dict[str, str], title: str, path: Path) -> Path | None:
    ok = cells[column(cells, "status") == "ok"]
    if ok.empty or all(missing(v) for k in series.values() for v in column(ok, k)):
        return None
    unit = byte_unit(v for k in series.values() for v in column(ok, k))
    fig, ax = _figure(len(ok), title.format(unit=unit))
    width = 0.8 / len(series)
    for i, (name, key) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(ok))]
        heights = [unit.value(v) for v in column(ok, key)]
        bars = ax.bar(xs, heights, width=width, label=name)
        ax.bar_label(bars, labels=[unit(v) for v in column(ok, key)], fontsize=6, padding=1)
    ax.set_xticks(range(len(ok)), list(ok["label"]), fontsize=8, rotation=20, ha="right")
    ax.set_ylabel(unit.name)
    ax.legend(fontsize=8)
    fig.savefig(path)
    return path


def steady_vs_peak(cells: pd.DataFrame, path: Path) -> Path | None:
    """Steady and peak bytes (largest rank) side by side for each cell."""
    return _bars(cells, {"steady": "memory.steady_bytes_max", "peak": "memory.peak_bytes_max"},
                 "Steady vs training peak, largest rank ({unit})", path)


def step_times(cells: pd.DataFrame, path: Path) -> Path | None:
    """The distribution of timed step times (slowest rank per step) for each cell; unstable cells in red."""
    ok = cells[column(cells, "status") == "ok"]
    data = [(r["label"], list(r["timing.step_ms"]), bool(r.get("timing.unstable"))) for _, r in ok.iterrows()
            if isinstance(r.get("timing.step_ms"), list) and r["timing.step_ms"]]
    if not data:
        return None
    fig, ax = _figure(len(data), "Step time per timed step, slowest rank (ms); red: unstable, trend only")
    ax.boxplot([d for _, d, _ in data], positions=range(len(data)), widths=0.5, showfliers=False)
    for i, (_, d, unstable) in enumerate(data):
        jitter = [i + 0.12 * ((k % 5) - 2) / 2 for k in range(len(d))]
        ax.scatter(jitter, d, s=12, alpha=0.7, color="#C44E52" if unstable else "#4C72B0", zorder=3)
    ax.set_xticks(range(len(data)), [label for label, _, _ in data], fontsize=8, rotation=20, ha="right")
    for tick, (_, _, unstable) in zip(ax.get_xticklabels(), data):
        tick.set_color("#C44E52" if unstable else "black")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    fig.savefig(path)
    return path


#: Hatches of the process groups in the collectives plot; the default group (``world``) is plain.
GROUP_HATCHES = {WORLD: "", "shard": "..", "replicate": "//"}


def _payload_by_group(row: pd.Series, ops: list[str]) -> dict[tuple[str, str], float]:
    """``{(op, mesh_dim): payload bytes per step}`` of one cell: its ``collectives.groups`` where recorded, else
    each op's payload as the default group's (a cell written before the groups were)."""
    out: dict[tuple[str, str], float] = {}
    for op in ops:
        groups = {dim: g["payload_bytes"] for (o, dim), g in groups_of(row).items()
                  if o == op and not missing(g.get("payload_bytes"))}
        total = row.get(f"collectives.payload_bytes.{op}")
        for dim, nbytes in (groups or ({WORLD: total} if not missing(total) else {})).items():
            out[(op, dim)] = float(nbytes)
    return out


def collective_payload(cells: pd.DataFrame, path: Path) -> Path | None:
    """Payload per step by op (stacked) for each cell, each op split by the process groups of its calls (hatched:
    hybrid sharding's shard and replicate groups), with the expected total as a black tick."""
    ok = cells[column(cells, "status") == "ok"]
    ops = [op for op in [*OPS, *sorted({k.split(".")[-1] for k in ok.columns
                                        if k.startswith("collectives.payload_bytes.")} - set(OPS))]
           if f"collectives.payload_bytes.{op}" in ok.columns]
    if not ops or all(missing(v) for v in column(ok, "collectives.payload_total_bytes")):
        return None
    unit = byte_unit(column(ok, "collectives.payload_total_bytes"))
    parts = [_payload_by_group(row, ops) for _, row in ok.iterrows()]
    dims = sorted({dim for p in parts for _, dim in p} - {WORLD}, key=lambda d: (d not in GROUP_HATCHES, d))
    title = f"Collective payload per step by op, rank 0 ({unit}, nccl-tests S)"
    fig, ax = _figure(len(ok), title + ("; hatched: the op's calls within a process group" if dims else ""))
    bottom, labelled = [0.0] * len(ok), set()
    for op in ops:  # each op's segment, split by the process groups its calls ran over (hybrid sharding)
        for dim in [WORLD, *dims]:
            heights = [unit.value(p.get((op, dim), 0.0)) for p in parts]
            if not any(heights):
                continue
            ax.bar(range(len(ok)), heights, bottom=bottom, width=0.6, color=OP_COLOURS.get(op),
                   hatch=GROUP_HATCHES.get(dim, "xx"), edgecolor="white" if dim != WORLD else None,
                   label=None if op in labelled else op)
            labelled.add(op)
            bottom = [b + h for b, h in zip(bottom, heights)]
    expected = [sum(0.0 if missing(row.get(f"collectives.expected_payload_bytes.{op}")) else
                    unit.value(row.get(f"collectives.expected_payload_bytes.{op}")) for op in ops)
                for _, row in ok.iterrows()]
    ax.scatter(range(len(ok)), expected, marker="_", s=600, color="black", zorder=3, label="expected total")
    ax.set_xticks(range(len(ok)), list(ok["label"]), fontsize=8, rotation=20, ha="right")
    ax.set_ylabel(unit.name)
    handles = ax.get_legend_handles_labels()[0] + [  # one entry per group: its hatch
        Patch(facecolor="white", edgecolor="black", hatch=GROUP_HATCHES.get(dim, "xx"), label=f"{dim} group")
        for dim in dims]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars
    fig.savefig(path)
    return path


#: Categories of the peak model and of MemTracker, stacked in this order (anything else: "other").
PEAK_CATEGORIES = {"activations": "#4C72B0", "temporaries": "#DD8452", "parameters": "#55A868", "gradients": "#C44E52",
                   "optimizer_state": "#8172B3", "unsharded": "#DA8BC3", "comm": "#CCB974", "other": "#8C8C8C"}


def planned_peaks(cells: pd.DataFrame, path: Path) -> Path | None:
    """For each cell, the phase with the largest measured bytes above steady: the peak model's prediction (left, P)
    beside the measurement (right, M), stacked by category; negative categories (gradients ``zero_grad`` freed) are
    drawn below zero."""
    ok = cells[column(cells, "status") == "ok"]
    bars: list[tuple[str, str, dict[str, float]]] = []
    for _, row in ok.iterrows():
        phases = {ph: row.get(f"plan.memory.phases.{ph}.measured_bytes") for ph in ("forward", "backward", "optimizer")}
        phases = {ph: v for ph, v in phases.items() if not missing(v)}
        if not phases or missing(row.get(f"plan.memory.phases.{next(iter(phases))}.predicted_bytes")):
            continue
        ph = max(phases, key=lambda k: phases[k])
        for side in ("predicted", "measured"):
            prefix = f"plan.memory.phases.{ph}.{side}_by_category."
            cats: dict[str, float] = {}
            for key in (k for k in ok.columns if k.startswith(prefix)):
                v = row.get(key)
                if not missing(v):
                    name = key[len(prefix):]
                    name = name if name in PEAK_CATEGORIES else "other"
                    cats[name] = cats.get(name, 0.0) + float(v)
            bars.append((f"{row['label']}\n{ph}", side, cats))
    if not bars:
        return None
    unit = byte_unit(sum(v for v in cats.values() if v > 0) for _, _, cats in bars)
    fig, ax = _figure(len(bars) // 2, f"Peak phase above steady, largest rank: planned (P) beside measured (M), {unit}")
    labelled: set[str] = set()
    for i, (label, side, cats) in enumerate(bars):
        x = i // 2 * 2.6 + (0 if side == "predicted" else 1)
        up = down = 0.0
        for name, colour in PEAK_CATEGORIES.items():
            h = unit.value(cats.get(name, 0.0))
            base = up if h >= 0 else down
            ax.bar(x, h, bottom=base, width=0.9, color=colour, label=name if h and name not in labelled else None)
            labelled |= {name} if h else set()
            up, down = (up + h, down) if h >= 0 else (up, down + h)
    ax.set_xticks([i // 2 * 2.6 + (i % 2) for i in range(len(bars))],
                  ["P" if i % 2 == 0 else "M" for i in range(len(bars))], fontsize=7)
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    for i in range(0, len(bars), 2):
        ax.text(i // 2 * 2.6 + 0.5, -0.09, bars[i][0], transform=trans, ha="center", va="top", fontsize=7)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_ylabel(unit.name)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=7)
    fig.savefig(path)
    return path


#: File name -> (plot function, caption, key of the table it is shown under), in the order the report shows them.
PLOTS: dict[str, tuple[Callable[[pd.DataFrame, Path], Path | None], str, str]] = {
    "report_state_bytes.png": (state_bytes, "Per-rank parameter, gradient and optimizer bytes", "state"),
    "report_memory.png": (steady_vs_peak, "Steady vs peak memory", "memory"),
    "report_peak_model.png": (planned_peaks, "Peak phase above steady: the peak model beside the measurement, by "
                                             "category", "memory"),
    "report_collectives.png": (collective_payload, "Collective payload by op and process group", "collectives"),
    "report_step_times.png": (step_times, "Step-time distributions", "timing"),
    "report_time_planned.png": (planned_vs_measured, "Step time planned vs measured", "time"),
}
