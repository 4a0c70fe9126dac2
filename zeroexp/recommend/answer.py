"""The answer: each recommended configuration as the JSON contract's record (docs/results.md, ``python -m
zeroexp.recommend``), the ties, the binding constraint, the command that runs it; and its table in 100 columns."""

from __future__ import annotations

import shlex
from typing import Any

from zeroexp.recommend.search import Evaluator, Problem, Scored
from zeroexp.recommend.space import Config, run_overrides

__all__ = ["recommendation", "mark_ties", "command", "label", "render", "notes_of", "picture_fields", "PICTURED"]

#: The peak's fields a recommendation and a nearest change carry beside their figures, the terms the answer's
#: picture draws (``format=html``: zeroexp.report.plan_picture): the device's state by kind, the steady buffers, the
#: figures judge_fits adds without a peak model, the device and its usable part, NCCL's communicators.
PICTURED = ("param_bytes", "grad_bytes", "optim_bytes", "master_bytes", "device_bytes", "host_bytes",
            "gather_floor_bytes", "workspace_bytes", "steady_bytes", "row_activation_bytes", "device_memory_bytes",
            "usable_memory_bytes", "headroom", "nccl")


def label(c: Config) -> str:
    """A configuration in a few words: row, precision, offload, checkpointing, micro-batch x grad_accum, knobs."""
    parts = [c.row, c.precision]
    if c.offload != "none":
        parts.append(f"offload={c.offload}")
    if c.checkpointing:
        parts.append("ac" if c.checkpointing.mode == "full" else f"ac={c.checkpointing.label}")
    parts.append(f"mb{c.micro_batch}x{c.grad_accum}")
    if c.prefetch is not None:
        parts.append(f"pf={c.prefetch}")
    if c.bucket_cap_mb is not None:
        parts.append(f"cap{c.bucket_cap_mb:g}")
    if c.shard_size is not None:
        parts.append(f"shard{c.shard_size}")
    if c.sync_each_microbatch:
        parts.append("sync_each")
    if c.overlap_comm:
        parts.append("overlap_comm")
    return " ".join(parts)


def command(overrides: list[str], world_size: int, ranks_per_node: int | None) -> str:
    """The line that runs the configuration: ``python -m zeroexp`` on one node (the local launcher starts the
    ranks), torchrun on every node beyond it (docs/cluster.md; ``$HEAD`` the rendezvous host, ``$ID`` the job)."""
    args = " ".join(shlex.quote(o) for o in overrides)
    if ranks_per_node is None or world_size <= ranks_per_node:
        return f"python -m zeroexp {args}"
    nodes = -(-world_size // ranks_per_node)
    return (f"torchrun --nnodes={nodes} --nproc-per-node={ranks_per_node} --rdzv-backend=c10d "
            f"--rdzv-endpoint=$HEAD:29400 --rdzv-id=$ID -m zeroexp launcher=torchrun {args}")


def _binding(ev: Evaluator, s: Scored) -> dict[str, Any]:
    """What binds: the memory category holding the most bytes at the peak, and the collective whose calls cost the
    predicted step the most (the step with that op left out, ``predict_on(without=)``); None where no op costs it
    anything (all hidden)."""
    cats = s.peak.get("by_category") or {}
    memory = max(cats.items(), key=lambda kv: kv[1]) if cats else None
    best = None
    for op in _ops(ev, s.config):
        saved = s.step.step_s - ev.step(s.config, without=op).step_s
        if saved > 0 and (best is None or saved > best[1]):
            best = (op, saved)
    return {"memory": None if memory is None else {"category": memory[0], "bytes": int(memory[1])},
            "collective": None if best is None else {"op": best[0], "costs_ms": 1e3 * best[1]}}


def _ops(ev: Evaluator, c: Config) -> list[str]:
    from zeroexp.formulas import LAYOUTS, step_collectives

    return sorted(step_collectives(LAYOUTS[c.row], ev.groups(c), ev.itemsize(c), ev.knobs(c)))


def picture_fields(p: Problem, s: Scored) -> dict[str, Any]:
    """What the answer's picture draws beyond the contract's figures (:data:`PICTURED`, from the peak; null where
    the peak has none), the row and offload (which state kinds the device holds), ``recompute_ms`` and the
    ``network_source`` the step was timed on."""
    peak = s.peak or {}
    return {"strategy": s.config.row, "offload": s.config.offload, **{k: peak.get(k) for k in PICTURED},
            "recompute_ms": 1e3 * s.step.recompute_s, "network_source": p.networks[s.config.precision].source}


def recommendation(ev: Evaluator, s: Scored, model_overrides: list[str], ranks_per_node: int | None
                   ) -> dict[str, Any]:
    """The contract's record of one judged configuration (docs/results.md)."""
    p: Problem = ev.p
    c, t, peak = s.config, s.step, s.peak or {}
    overrides = run_overrides(c, model_overrides, p.world_size)
    flops = p.flops(c.micro_batch, c.checkpointing) if p.flops else None  # what the step runs, its recompute too
    model_flops = p.flops(c.micro_batch, False) if p.flops else None  # the model's: MFU counts no recompute [PaLM B]
    peak_flops = p.peak_flops.get(c.precision)
    mfu = model_flops * c.grad_accum / (t.step_s * peak_flops) if model_flops and peak_flops else None
    hfu = flops * c.grad_accum / (t.step_s * peak_flops) if flops and peak_flops else None
    peak_bytes = peak.get("peak_bytes")
    judged = peak.get("fits_bytes")
    rec = {
        "config": label(c), "overrides": overrides, "command": command(overrides, p.world_size, ranks_per_node),
        "fits": peak.get("fits"), "fits_on": peak.get("fits_on"), "peak_bytes": peak_bytes,
        "fits_bytes": judged, "reserved_peak_bytes": peak.get("reserved_peak_bytes"),
        "nccl_bytes": peak.get("nccl_bytes"), "context_bytes": peak.get("context_bytes"),
        "device_total_bytes": peak.get("device_total_bytes"),
        "free_fraction": None if judged is None else (p.memory - judged) / p.memory,
        "peak_phase": peak.get("peak_phase"), "peak_note": peak.get("peak_note"),
        "step_ms": 1e3 * t.step_s, "comm_ms": 1e3 * t.comm_s, "exposed_comm_ms": 1e3 * t.exposed_comm_s,
        "tokens_per_s": p.tokens * c.micro_batch * c.grad_accum * p.world_size / t.step_s,
        "flops_per_rank_step": None if flops is None else flops * c.grad_accum, "mfu": mfu, "hfu": hfu,
        "overlap_rule": t.rule, "binding": _binding(ev, s), "tie_with": [], "notes": _notes(c, t, flops, peak_flops),
        **picture_fields(p, s),
    }
    return rec


def notes_of(c: Config, t: Any) -> list[str]:
    """What a configuration's step leaves out: offload's transfers, any overlap (every collective exposed)."""
    notes = []
    if c.offload != "none":
        notes.append(f"offload={c.offload}: the host transfers and the host's optimizer step are not in the step "
                     "time (a lower bound)")
    if t.comm_s > 0 and "no overlap" in t.rule:  # the rule's own words (DeepSpeed's rows; a device without overlap)
        notes.append(f"no overlap modelled: every collective exposed ({t.rule})")
    return notes


def _notes(c: Config, t: Any, flops: float | None, peak_flops: float | None) -> list[str]:
    notes = notes_of(c, t)
    if flops is None:
        notes.append("mfu: FLOPs not counted for this model (a parameter count has no operations to count)")
    elif peak_flops is None:
        notes.append("mfu: the device's peak FLOP/s is not known (the network gives none)")
    return notes


def mark_ties(records: list[dict[str, Any]], tolerance: float) -> None:
    """Each record's ``tie_with``: the ranks (1-based) of the other records whose predicted step is within
    ``tolerance`` (a fraction of the faster) of its own: closer than the model's own error, so not told apart."""
    for i, a in enumerate(records):
        a["tie_with"] = [j + 1 for j, b in enumerate(records) if j != i and
                         abs(a["step_ms"] - b["step_ms"]) <= tolerance * min(a["step_ms"], b["step_ms"])]


def _star(fits_on: str) -> str:
    """The mark of a figure not the peak model's (state + activations, or state alone)."""
    return "" if fits_on in ("peak", "reserved") else "*"


def _gb(x: float | None) -> str:
    """Bytes in GiB (2^30, as a run's memory is reported), or MiB below 1 GiB."""
    return "-" if x is None else f"{x / 2**30:.1f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def _binds(b: dict[str, Any]) -> str:
    mem, coll = b["memory"], b["collective"]
    parts = [f"{mem['category']} {_gb(mem['bytes'])} at the peak" if mem else None,
             f"{coll['op']} costs the step {coll['costs_ms']:.2f} ms" if coll else "no collective costs the step"]
    return "; ".join(p for p in parts if p)


def render(answer: dict[str, Any], console: Any) -> None:
    """The answer as a table of 100 columns, then each configuration's binding constraint and command, the nearest
    changes when nothing fits, and what the figures rest on."""
    from rich.markup import escape
    from rich.table import Table

    recs = answer["recommendations"]
    mem = answer["device_memory_bytes"]
    table = Table(title=f"The {len(recs)} fastest of {answer['searched']:,} configurations that fit "
                        f"{_gb(mem)} less {100 * answer['headroom']:.0f} % (N={answer['world_size']})",
                  width=100, pad_edge=False)
    for name in ("#", "configuration", "peak", "free", "step ms", "tokens/s", "MFU", "exposed ms"):
        table.add_column(name, justify="left" if name == "configuration" else "right", overflow="fold")
    for i, r in enumerate(recs, 1):
        tie = f" ={','.join(map(str, r['tie_with']))}" if r["tie_with"] else ""
        table.add_row(f"{i}{tie}", r["config"], _gb(r["fits_bytes"]) + _star(r["fits_on"]),
                      f"{100 * r['free_fraction']:.0f}%", f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.3g}",
                      "-" if r["mfu"] is None else f"{100 * r['mfu']:.0f}%", f"{r['exposed_comm_ms']:.2f}")
    if recs:
        console.print(table)
        for i, r in enumerate(recs, 1):
            console.print(f"{i}: binds: {_binds(r['binding'])}", overflow="fold")
            console.print(f"   {escape(r['command'])}", overflow="fold")
            for note in r["notes"] + ([r["peak_note"]] if r["peak_note"] else []):
                console.print(f"   note: {note}", overflow="fold")
    else:
        console.print(f"Nothing of {answer['searched']:,} configurations fits {_gb(mem)} less "
                      f"{100 * answer['headroom']:.0f} % at N={answer['world_size']}; the fastest would be "
                      f"{answer['fastest']['config']} ({answer['fastest']['step_ms']:.2f} ms). The nearest changes:",
                      overflow="fold")
    for ch in answer.get("nearest_changes") or []:
        console.print(f"change: {ch['change']}: {ch['config']}, peak {_gb(ch['fits_bytes'])}"
                      + _star(ch["fits_on"])
                      + f", {ch['step_ms']:.2f} ms ({ch['cost_ms']:+.2f} ms against the fastest)", overflow="fold")
        console.print(f"   {escape(ch['command'])}", overflow="fold")
        for note in ch["notes"]:
            console.print(f"   note: {note}", overflow="fold")
    if answer.get("nearest_changes") == []:
        console.print("No single change searched makes a configuration fit.")
    for note in answer["notes"]:
        console.print(f"note: {note}", overflow="fold")
