"""The planner's and the recommender's answer as a picture (``format=html``): per row two stacked horizontal bars,
the device's memory by named term against the usable and the device memory, and the step by part.

Every drawn number is a field of the row's record or the difference of two of them, named beside it on the page
and in the segment's ``data-field`` (``steady_bytes - device_bytes``); its value is in ``data-bytes`` (``data-ms``
for the step), so that a test reads the page back against the record (tests/test_plan_picture.py). The page is
self-contained: inline SVG and the report's inline style (``zeroexp.report.pages.CSS``), no script, no fetch.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from zeroexp.formulas import LAYOUTS, STATE_KINDS, offloaded_kinds
from zeroexp.plan.core import FITS_ON
from zeroexp.report.pages import CSS

__all__ = ["Part", "memory_parts", "step_parts", "plan_page", "answer_page", "KIND_COLOURS"]

#: The state kinds' colours, the report's plots' too (zeroexp.report.plots: every other kind there is "other").
KIND_COLOURS = {"param": "#4C72B0", "grad": "#DD8452", "optim": "#55A868", "master": "#8172B3", "other": "#8C8C8C"}
_COLOURS = {**KIND_COLOURS, "steady buffers + workspace": "#A6A6A6", "gather floor": "#64B5CD",
            "workspace": "#A6A6A6", "activations": "#C44E52", "allocator slack": "#E6D36B", "NCCL": "#937860",
            "CUDA context": "#DA8BC3", "compute": "#4C72B0", "recompute": "#8172B3", "exposed communication": "#C44E52"}
_WIDTH, _BAR, _LEFT, _END = 1150, 22, 130, 250  # the SVG's width, a bar's height, the room for its name and end (px)


@dataclass(frozen=True)
class Part:
    """One segment: its name, the record's field it draws (or ``a - b`` of two fields), its value, a tooltip."""

    name: str
    field: str
    value: float
    detail: str = ""
    colour: str = "#8C8C8C"


def _state(record: dict[str, Any]) -> list[Part]:
    """The device's model state: each device-resident kind (its ``<kind>_bytes``) where they add up to
    ``device_bytes`` (the largest rank's sum), else ``device_bytes`` whole (a row whose ranks differ by kind)."""
    row = LAYOUTS.get(record.get("strategy") or "")
    host = offloaded_kinds(row, record["offload"]) if row is not None and record.get("offload") else frozenset()
    kinds = [k for k in STATE_KINDS if k not in host and record.get(f"{k}_bytes")]
    if sum(record[f"{k}_bytes"] for k in kinds) == record["device_bytes"]:
        return [Part(k, f"{k}_bytes", record[f"{k}_bytes"], f"{k} on the device", KIND_COLOURS[k]) for k in kinds]
    return [Part("state", "device_bytes", record["device_bytes"], "the largest rank's device state (its kinds' "
                 "largest ranks differ: " + ", ".join(f"{k}_bytes={record[f'{k}_bytes']:,}" for k in kinds) + ")")]


def _nccl_detail(record: dict[str, Any]) -> str:
    comms = (record.get("nccl") or {}).get("by_communicator") or []
    return "; ".join(f"{c['name']} ({c['size']} ranks{''.join(', ' + op for op in c.get('ops') or [])}): "
                     f"{c['bytes']:,} B"
                     + "".join(f", {k} {c[k]:,}" for k in ("setup_bytes", "ring_bytes", "tree_bytes", "nvls_bytes")
                               if c.get(k)) for c in comms)


def memory_parts(record: dict[str, Any]) -> list[Part]:
    """The terms of the figure ``fits`` is judged on (``fits_bytes``), by name; none negative, none of 0 bytes.

    With a peak model: the state, the steady buffers and workspace (``steady_bytes - device_bytes``), the peak
    phase's transients (``peak_bytes - steady_bytes``; where the step frees state between steps, so that
    ``steady_bytes`` < ``device_bytes``, the two as one: ``peak_bytes - device_bytes``), the allocator's slack
    (``reserved_peak_bytes - peak_bytes``). Without one: the state, ``gather_floor_bytes``, ``workspace_bytes`` and
    ``row_activation_bytes`` (``zeroexp.plan.core.judge_fits``). Then ``nccl_bytes`` and ``context_bytes`` where
    the record has them (a GPU)."""
    parts = _state(record)
    phase = record.get("peak_phase") or "?"
    if record.get("peak_bytes") is not None:
        if record["steady_bytes"] >= record["device_bytes"]:
            parts += [Part("steady buffers + workspace", "steady_bytes - device_bytes",
                           record["steady_bytes"] - record["device_bytes"], "collective buffers, cuBLAS workspaces"),
                      Part("activations", "peak_bytes - steady_bytes", record["peak_bytes"] - record["steady_bytes"],
                           f"activations and transients at the peak phase, {phase}")]
        elif record["peak_bytes"] >= record["device_bytes"]:
            parts.append(Part("activations", "peak_bytes - device_bytes", record["peak_bytes"] - record["device_bytes"],
                              f"steady buffers and the transients at the peak phase, {phase} (the step frees state "
                              "between steps: steady_bytes < device_bytes)"))
        else:
            parts = [Part("state", "peak_bytes", record["peak_bytes"], f"the peak at {phase}, not split (the state's "
                          "kinds exceed it)")]
        if record.get("reserved_peak_bytes") is not None:
            parts.append(Part("allocator slack", "reserved_peak_bytes - peak_bytes",
                              record["reserved_peak_bytes"] - record["peak_bytes"],
                              "the CUDA caching allocator's segments beyond the live bytes"))
    else:
        parts += [Part("gather floor", "gather_floor_bytes", record.get("gather_floor_bytes") or 0,
                       "the unsharded units a step gathers at once"),
                  Part("workspace", "workspace_bytes", record.get("workspace_bytes") or 0, "cuBLAS workspaces"),
                  Part("activations", "row_activation_bytes", record.get("row_activation_bytes") or 0,
                       "one forward's activations (no peak model)")]
    if record.get("nccl_bytes"):
        parts.append(Part("NCCL", "nccl_bytes", record["nccl_bytes"], _nccl_detail(record)))
    if record.get("context_bytes"):
        parts.append(Part("CUDA context", "context_bytes", record["context_bytes"], "the CUDA context"))
    return [Part(p.name, p.field, p.value, p.detail, _COLOURS.get(p.name, p.colour)) for p in parts if p.value > 0]


def step_parts(record: dict[str, Any]) -> list[Part]:
    """The step's parts where a network timed it: compute (``step_ms - exposed_comm_ms - recompute_ms``: forward,
    backward, the optimizer step and the framework's work; the record has no field for the optimizer alone),
    ``recompute_ms`` and ``exposed_comm_ms``; none without ``step_ms``."""
    if record.get("step_ms") is None:
        return []
    recompute = record.get("recompute_ms") or 0.0
    parts = [Part("compute", "step_ms - exposed_comm_ms - recompute_ms" if "recompute_ms" in record
                  else "step_ms - exposed_comm_ms", record["step_ms"] - record["exposed_comm_ms"] - recompute,
                  "forward, backward, the optimizer step, the framework's own work"),
             Part("recompute", "recompute_ms", recompute, "the checkpointed units' forward again, inside backward"),
             Part("exposed communication", "exposed_comm_ms", record["exposed_comm_ms"],
                  f"of comm_ms={record.get('comm_ms', 0):.4g} ms, the part not hidden behind compute")]
    return [Part(p.name, p.field, p.value, p.detail, _COLOURS[p.name]) for p in parts if p.value > 0]


def _bytes(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.2f} MiB" if x >= 2**20 else f"{x:,.0f} B"


def _bar(parts: list[Part], scale: float, kind: str, lines: list[tuple[str, str, float]], end: str = "",
         data: str = "") -> str:
    """One bar as inline SVG: its segments (``data-field``, ``data-bytes`` or ``data-ms``, a tooltip each),
    vertical lines (their field and value) at ``lines``, ``end`` written after its last segment, ``data`` the
    attributes of the ``svg``."""
    esc, attr = html.escape, "data-bytes" if kind == "memory" else "data-ms"
    unit = _bytes if kind == "memory" else (lambda v: f"{v:.4g} ms")
    span = _WIDTH - _LEFT - _END
    out, x = [], float(_LEFT)
    for p in parts:
        w = span * p.value / scale if scale else 0.0
        tip = f"{p.name}: {p.field} = {unit(p.value)}" + (f" ({p.detail})" if p.detail else "")
        out.append(f'<rect class="seg" data-bar="{kind}" data-name="{esc(p.name)}" data-field="{esc(p.field)}" '
                   f'{attr}="{p.value!r}" x="{x:.2f}" y="18" width="{w:.2f}" height="{_BAR}" fill="{p.colour}">'
                   f"<title>{esc(tip)}</title></rect>")
        x += w
    for name, field, value in lines:
        lx = _LEFT + span * value / scale
        out.append(f'<line class="limit" data-field="{field}" {attr}="{value!r}" x1="{lx:.2f}" x2="{lx:.2f}" y1="12" '
                   f'y2="{_BAR + 24}" stroke="#cf222e" stroke-width="1.5" stroke-dasharray="4 2"><title>'
                   f"{esc(name)}: {field} = {esc(unit(value))}</title></line>"
                   f'<text x="{lx - 3:.2f}" y="10" font-size="10" text-anchor="end">{esc(name)}</text>')
    if end:
        out.append(f'<text x="{x + 4:.2f}" y="{18 + _BAR * 0.7:.1f}" font-size="11">{esc(end)}</text>')
    label = "memory" if kind == "memory" else "step"
    return (f'<svg class="bar {kind}" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_BAR + 28}" '
            f'role="img" aria-label="{label}"{data}><text x="0" y="{18 + _BAR * 0.7:.1f}" font-size="12">{label}</text>'
            f'<rect x="{_LEFT}" y="18" width="{span}" height="{_BAR}" fill="#f6f8fa" stroke="#d0d7de"/>'
            + "".join(out) + "</svg>")


def _legend(parts: list[Part], kind: str) -> str:
    unit = _bytes if kind == "memory" else (lambda v: f"{v:.4g} ms")
    rows = "".join(f'<tr><td><span class="sw" style="background:{p.colour}"></span>{html.escape(p.name)}</td>'
                   f"<td><code>{html.escape(p.field)}</code></td><td class=\"num\">{unit(p.value)}</td>"
                   f"<td class=\"soft\">{html.escape(p.detail)}</td></tr>" for p in parts)
    return f'<table class="legend"><tbody>{rows}</tbody></table>'


def _row(title: str, record: dict[str, Any], scale: float, step_scale: float, key: str) -> str:
    """One row: its memory bar (what fits is judged on, labelled), its step bar where timed, their legends."""
    esc = html.escape
    parts = memory_parts(record)
    on, judged, fits = record.get("fits_on"), record.get("fits_bytes"), record.get("fits")
    verdict = {True: "fits", False: "does not fit", None: "fit not judged (no device_memory)"}[fits]
    lines = [(name, f, record[f]) for name, f in (("usable", "usable_memory_bytes"), ("device", "device_memory_bytes"))
             if record.get(f) is not None]
    head = (f'<section class="row" id="{esc(key)}" data-key="{esc(key)}" data-fits-on="{esc(str(on))}" '
            f'data-fits-bytes="{judged}"><h2>{esc(title)} · {verdict}</h2>'
            f'<p class="meta">fits judged on <code>fits_bytes</code> = {_bytes(judged)} ({judged:,} B), '
            f"<code>fits_on</code> = {esc(str(on))}: {esc(FITS_ON.get(on, ''))}"
            + (f"; against <code>usable_memory_bytes</code> = {_bytes(record['usable_memory_bytes'])} "
               f"(<code>device_memory_bytes</code> {_bytes(record['device_memory_bytes'])} less headroom "
               f"{100 * (record.get('headroom') or 0):.0f} %)" if record.get("usable_memory_bytes") else "") + "</p>")
    body = [head, _bar(parts, scale, "memory", lines, f"fits_bytes {_bytes(judged)}"), _legend(parts, "memory")]
    if record.get("peak_bytes") is None and record.get("peak_note"):
        body.append(f'<p class="note">no peak model: {esc(record["peak_note"])}</p>')
    elif record.get("peak_phase"):
        body.append(f'<p class="note">peak phase: {esc(record["peak_phase"])}</p>')
    steps = step_parts(record)
    if steps:
        tokens = record.get("tokens_per_s")
        end = f"step_ms {record['step_ms']:.4g} ms" + ("" if tokens is None else f", tokens_per_s {tokens:,.0f}")
        body += [_bar(steps, step_scale, "step", [], end, f' data-step-ms="{record["step_ms"]!r}"'
                      + ("" if tokens is None else f' data-tokens-per-s="{tokens!r}"')), _legend(steps, "step"),
                 f'<p class="meta"><code>step_ms</code> = {record["step_ms"]:.4g} ms, <code>comm_ms</code> = '
                 f"{record.get('comm_ms', 0):.4g} ms, <code>tokens_per_s</code> = "
                 + (f"{record['tokens_per_s']:,.0f}" if record.get("tokens_per_s") is not None else "n/a")
                 + (f" · {esc(record['overlap_rule'])}" if record.get("overlap_rule") else "") + "</p>"]
    else:
        body.append('<p class="note">no step time: give network= (and batch_size=) to time the step</p>')
    return "\n".join(body) + "</section>"


_PICTURE_CSS = """
section.row{border-top:1px solid #d0d7de;margin-top:1.2em;padding-top:.4em}section.row h2{margin:.3em 0}
svg.bar{display:block;max-width:100%;height:auto;margin:.3em 0}table.legend{font-size:.85em}
table.legend td{padding:.15em .5em}.sw{display:inline-block;width:.9em;height:.9em;margin-right:.4em;\
vertical-align:-.1em;border:1px solid #d0d7de}
"""


def _page(title: str, intro: list[str], rows: list[tuple[str, dict[str, Any], str]], notes: list[str]) -> str:
    """The page: a heading, what the figures rest on, the rows on one scale per bar, the notes."""
    esc = html.escape
    totals = [sum(p.value for p in memory_parts(r)) for _, r, _ in rows]
    scale = max([*totals, *(r.get("device_memory_bytes") or 0 for _, r, _ in rows)], default=0) or 1
    step_scale = max([r.get("step_ms") or 0 for _, r, _ in rows], default=0) or 1
    sources = sorted({r["network_source"] for _, r, _ in rows if r.get("network_source")})
    rest = [f"The step time rests on {esc(s)}" + (": a preset's compute is computed from its published rates, not "
            "measured on it" if s.startswith("preset") else "") + "." for s in sources]
    parts = [f"<h1>{esc(title)}</h1>", *(f'<p class="meta">{esc(line)}</p>' for line in intro),
             '<p class="note">Every drawn number is a field of the row\'s record (python -m zeroexp.plan / recommend '
             "format=json) or the difference of two, named beside it; all are computed by the planner's models, "
             "none measured. The bars of every row share one scale (memory: the largest device memory or total; "
             "step: the slowest step).</p>", *(f'<p class="note">{line}</p>' for line in rest)]
    parts += [_row(t, r, scale, step_scale, k) for t, r, k in rows]
    if notes:
        parts.append('<h2>Notes</h2><ul class="note">' + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{CSS}{_PICTURE_CSS}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")


def plan_page(records: list[dict[str, Any]], notes: list[str]) -> str:
    """``python -m zeroexp.plan format=html``: one row per strategy x world size."""
    first = records[0] if records else {}
    intro = [f"model {first.get('model')}, {first.get('numel', 0):,} parameters, precision {first.get('precision')}, "
             f"offload {first.get('offload')}, batch_size {first.get('batch_size')}, grad_accum "
             f"{first.get('grad_accum')}, device {first.get('device_semantics')}"] if records else ["no rows planned"]
    rows = [(f"{r['strategy']} · world_size={r['world_size']}", r, f"{r['strategy']}@{r['world_size']}")
            for r in records]
    return _page("zeroexp plan", intro, rows, notes)


def answer_page(answer: dict[str, Any]) -> str:
    """``python -m zeroexp.recommend format=html``: one row per recommendation, then each nearest change."""
    recs = answer["recommendations"]
    intro = [f"model {answer.get('model')}, {answer.get('numel', 0):,} parameters, world_size "
             f"{answer['world_size']}, network {answer.get('network')}, {answer['searched']:,} configurations "
             f"searched" + (f", the {len(recs)} fastest that fit" if recs else "")]
    if not recs and answer.get("fastest"):
        intro.append(f"Nothing fits; the fastest would be {answer['fastest']['config']} "
                     f"({answer['fastest']['step_ms']:.4g} ms). "
                     + ("The nearest changes that make one fit:" if answer.get("nearest_changes")
                        else "No single change searched makes a configuration fit."))
    rows = [(f"#{i} {r['config']}", r, f"rec{i}") for i, r in enumerate(recs, 1)]
    # a nearest change is listed only where it fits (its ``fits`` true, dropped from the record)
    rows += [(f"change: {ch['change']}: {ch['config']}", {**ch, "fits": True}, f"change{i}")
             for i, ch in enumerate(answer.get("nearest_changes") or [], 1)]
    return _page("zeroexp recommend", intro, rows, answer.get("notes") or [])
