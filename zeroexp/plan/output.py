"""The planner's output: readable tables (rich) or JSON records (bytes)."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from zeroexp.formulas.peak.deepspeed_terms import TERMS
from zeroexp.plan.core import FITS_ON, UNITS

__all__ = ["render_json", "render_tables", "fmt_size", "fastest_sentences"]

_UNIT_NOTE = {"GB": "GB = 1e9 bytes", "GiB": "GiB = 2^30 bytes"}
#: The mark beside ``fits`` of a row not judged on the peak model (``fits_on``).
_BASIS = {"device": "", "reserved": "", "peak": "", "state+activations": " (state+act)", "state": " (state)"}
_REFERENCE = " [dim](reference)[/]"


def fmt_size(nbytes: int | None, unit: str) -> str:
    """Bytes in ``unit``: one decimal from 1 on (the ZeRO paper's Figure 1 style), else 3 significant digits."""
    if nbytes is None:
        return "n/a"
    value = nbytes / UNITS[unit]
    return "0" if value == 0 else f"{value:,.1f}" if value >= 1 else f"{value:.3g}"


def render_json(records: list[dict[str, Any]]) -> str:
    """One JSON object per strategy x world size, every size in bytes."""
    return json.dumps(records, indent=2)


def render_tables(records: list[dict[str, Any]], notes: list[str], unit: str, console: Console) -> None:
    """A memory table (per rank, at the optimizer boundary) and a communication table (per step)."""
    if not records:
        console.print("nothing to plan")
    else:
        first = records[0]
        what = (f"{first['numel']:,} parameters" + ("" if first["shapes_known"] else " (a count: one flat group, "
                "units unknown)") if first["model"] == "params"
                else f"model {first['model']}: {first['numel']:,} parameters")
        console.print(_memory_table(records, unit))
        acts = first.get("activation_bytes")
        traced = ("activations: one forward at the per-rank batch traced under FakeTensorMode (saved for backward, "
                  "plus output and loss), each row's in the dtypes it computes in (autocast or the module cast, as its "
                  "peak model traces it; without a peak model the fewer of the two, which its fits adds); peak: model "
                  "state + its steady buffers + the peak model's largest phase "
                  "(docs/planner.md; '-': no peak model for the row); init peak: building and wrapping the model "
                  "(init=meta: fits needs it too)" + (f"; Korthikanti et al. 34sbh+5as^2b: "
                  f"{fmt_size(first['korthikanti_bytes'], unit)} {unit}" if first.get("korthikanti_bytes") else "")
                  if acts is not None else "not modelled: activations (give model= and batch_size=)")
        cuda = first.get("device_semantics") == "cuda"
        console.print(f"{what} · precision {first['precision']} · offload {first['offload']} · Adam: fp32 moments "
                      f"8 B and fp32 master 4 B a parameter · {traced} · "
                      + ("reserved: the CUDA caching allocator's segments for the peak's live bytes; not modelled: "
                         "fragmentation beyond its rounding (docs/planner.md)" if cuda else
                         f"device semantics {first.get('device_semantics', 'cpu')}: no allocator modelled"))
        legend = _legend(records)
        console.print(legend + "\n" if legend else "")
        ds = [r for r in records if (r.get("ds_peak") or {}).get("terms")]
        if ds:
            console.print(_ds_terms_table(ds, unit))
            console.print("the highest moment of DeepSpeed's step (backward, stage 3's fp16 overflow check, the fp32 "
                          "copy, AdamW's update), term by term (computed, a lower bound: activations and scalars left "
                          "out; docs/planner.md, DeepSpeed's peak by term); estimator: DeepSpeed's own (2-byte "
                          "parameters; stage 3 with largest_layer=), and the same terms as ours; differs: + the terms "
                          "it does not count, @moment: those it counts that another moment holds\n")
        console.print(_comm_table(records, unit))
        console.print("S: the payload, the full array (nccl-tests PERFORMANCE.md); bus = S x all_reduce 2(N-1)/N, "
                      "all_gather and reduce_scatter (N-1)/N, broadcast and reduce 1, N the size of the call's "
                      "group (hybrid rows: shard_size for all_gather and reduce_scatter, N / shard_size for "
                      "all_reduce; fsdp2_full with reshard_after_forward=k: k for the all_gathers from a unit's "
                      "post-forward shard)\n")
        console.print(_checkpoint_table(records, unit))
        console.print("the tensors' bytes a checkpoint writes (computed, zeroexp/formulas/checkpoint.py; checked to "
                      "the byte in every checkpoint cell, plan.checkpoint; the files add serialization): full, rank 0 "
                      "gathers the whole state on its host and writes it alone; sharded, the ranks share it (DCP: "
                      "each rank's own decided at run time, the mean shown; zro's and DeepSpeed's rank 0 at stages "
                      "0-2 writes the whole module beside its share); '-': no sharded kind (the paper's stages)\n")
        if any((r["checkpoint"]["full"] or {}).get("peaks") for r in records):
            console.print(_checkpoint_peak_table(records, unit))
            console.print("what a checkpoint's save and load hold above what each rank held before (computed, "
                          "zeroexp/formulas/checkpoint_peak.py; judged in every checkpoint cell, plan.checkpoint): "
                          "device, the largest rank (rank 0's where it differs); host, what the host holds at the "
                          "phase's peak (an accelerator; '-': on the CPU, where it is in the device's, and a sharded "
                          "phase's host staging, not sized); '>=': a lower bound (what is not sized: the JSON rows' "
                          "unsized; on an accelerator every device figure, until a GPU cell has measured the terms "
                          "there); the host's: the files read or gathered, as computed\n")
        if "step_ms" in first:
            console.print(_time_table(records))
            console.print(f"computed on {first['network_source']} (zeroexp.formulas.time.overlap; docs/planner.md, "
                          "Step time); * the fastest strategy that fits, per world size, among the rows a strategy "
                          "runs; = a row the model cannot tell from it (within its measured error)")
            for line in fastest_sentences(records, unit):
                console.print(line)
            console.print()
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")


def _memory_table(records: list[dict[str, Any]], unit: str) -> Table:
    first = records[0]
    offload = any(r["host_bytes"] for r in records) or first["offload"] != "none"
    fits = first["device_memory_bytes"] is not None
    table = Table(title=f"Model state per rank (the largest rank) at the optimizer boundary, in {unit} "
                        f"({_UNIT_NOTE[unit]})")
    cols = ["strategy", "stage", "N", "params", "grads", "moments", "master", "total"]
    cols += ["host", "device"] if offload else []
    acts = any(r.get("activation_bytes") is not None for r in records)
    ac = first.get("activation_checkpointing") or "none"
    ckpt = "" if ac == "none" else ", checkpointed" if ac == "full" else f", checkpointed {ac}"
    accum = _accumulation(first)
    cols += ["gather floor"] + ([f"activations (batch {first['batch_size']}{accum}{ckpt})"] if acts else [])
    peaks = any(r.get("peak_bytes") is not None for r in records)
    cols += ["peak (phase)"] if peaks else []
    reserved = any(r.get("reserved_peak_bytes") is not None for r in records)
    cols += ["reserved"] if reserved else []
    beside = any(r.get("nccl_bytes") is not None for r in records)
    cols += ["NCCL", "device (smi)"] if beside else []
    cols += [f"init peak ({first.get('init', 'full')})"]
    cols += [f"fits {_room(first, unit)}"] if fits else []
    for i, c in enumerate(cols):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in records:
        row = [f"{r['strategy']} [dim]{r['label']}[/]" + (_REFERENCE if r["reference"] else ""), str(r["zero_stage"]),
               str(r["world_size"])]
        row += [fmt_size(r[k], unit)
                for k in ("param_bytes", "grad_bytes", "optim_bytes", "master_bytes", "total_bytes")]
        row += [fmt_size(r["host_bytes"], unit), fmt_size(r["device_bytes"], unit)] if offload else []
        row += [fmt_size(r["gather_floor_bytes"], unit)] + ([fmt_size(r.get("row_activation_bytes"), unit)]
                                                            if acts else [])
        row += ([f"{fmt_size(r['peak_bytes'], unit)} ({r['peak_phase']})" if r.get("peak_bytes") is not None
                 else "-"] if peaks else [])
        row += ([fmt_size(r["reserved_peak_bytes"], unit) if r.get("reserved_peak_bytes") is not None else "-"]
                if reserved else [])
        row += ([fmt_size(r.get("nccl_bytes"), unit) if r.get("nccl_bytes") is not None else "-",
                 fmt_size(r.get("device_total_bytes"), unit) if r.get("device_total_bytes") is not None else "-"]
                if beside else [])
        row += [fmt_size(r["init_peak_bytes"], unit) if r.get("init_peak_bytes") is not None else "-"]
        row += [_fits(r)] if fits else []
        table.add_row(*row)
    return table


def _ds_terms_table(records: list[dict[str, Any]], unit: str) -> Table:
    """DeepSpeed's rows' ``ds_peak``: the peak moment's terms, the estimator's figure beside its terms in ours."""
    held = {t for r in records for t in r["ds_peak"]["terms"]}
    terms = [t for t in TERMS if t in held]
    table = Table(title=f"DeepSpeed's peak by term, per rank, in {unit}")
    for i, c in enumerate(["strategy", "N", *terms, "peak (moment)", "estimator / same terms", "differs"]):
        table.add_column(c, justify="left" if i == 0 or c == "differs" else "right")
    for r in records:
        d, est = r["ds_peak"], r["ds_peak"]["estimator"]
        where: dict[str, list[str]] = {}  # phase -> the estimator's terms held there, not at the peak
        for t in est["elsewhere"]:
            where.setdefault(next((ph for ph, m in d["moments"].items() if t in m), "none"), []).append(t)
        differs = [f"+{t}" for t in est["extra"]] + [f"@{ph}: {' '.join(ts)}" for ph, ts in where.items()]
        table.add_row(r["strategy"], str(r["world_size"]),
                      *(fmt_size(d["terms"][t], unit) if t in d["terms"] else "-" for t in terms),
                      f"{fmt_size(d['bytes'], unit)} ({d['moment']})",
                      f"{fmt_size(est['bytes'], unit)} / {fmt_size(est['counted_bytes'], unit)}"
                      if est["bytes"] is not None else "-", " ".join(differs))
    return table


def _fits(r: dict[str, Any]) -> str:
    """``fits`` with what it was judged on, where that is not the peak model."""
    if r["fits"] is None:
        return "?"
    return ("yes" if r["fits"] else "[red]NO[/]") + (f"[dim]{_BASIS[r['fits_on']]}[/]" if _BASIS[r["fits_on"]] else "")


def _legend(records: list[dict[str, Any]]) -> str:
    """What fits was judged on in these tables, and the reference rows."""
    bases = list(dict.fromkeys(r["fits_on"] for r in records))
    out = ["fits judged on " + "; ".join(f"{_BASIS[b].strip() or 'unmarked'}: {FITS_ON[b]}" for b in bases)
           ] if records[0]["device_memory_bytes"] is not None else []
    if any(r["reference"] for r in records):
        out.append("(reference): the ZeRO paper's closed form, which no strategy runs: shown for comparison, never "
                   "recommended")
    return " · ".join(out)


def _accumulation(record: dict[str, Any]) -> str:
    """`` x K micro-batches`` and how the FSDP rows accumulate (``sync_each_microbatch``), or nothing at K=1."""
    k = record.get("grad_accum") or 1
    if k == 1:
        return ""
    how = "FSDP reducing each" if record.get("sync_each_microbatch") else "FSDP under no_sync"
    return f" x {k} micro-batches, {how}"


def _room(record: dict[str, Any], unit: str) -> str:
    """What ``fits`` was judged against: the usable memory, and the device's memory less its headroom where there
    is one (``zeroexp.plan.core.usable_bytes``)."""
    usable = f"{fmt_size(record['usable_memory_bytes'], unit)} {unit}"
    if not record["headroom"]:
        return usable
    return f"{usable} ({fmt_size(record['device_memory_bytes'], unit)} less {100 * record['headroom']:.3g} %)"


def fastest_sentences(records: list[dict[str, Any]], unit: str) -> list[str]:
    """Per world size, the fastest row a strategy runs that fits (the record's ``fastest``), and what its fits was
    judged on; or that no such row fits."""
    out = []
    for n in dict.fromkeys(r["world_size"] for r in records):
        rows = [r for r in records if r["world_size"] == n]
        best = next((r for r in rows if r.get("fastest")), None)
        room = _room(rows[0], unit) if rows[0]["device_memory_bytes"] is not None else None
        if best is None:
            out.append(f"N={n}: no row a strategy runs fits {room}" if room else f"N={n}: no row a strategy runs")
        elif best["fits"] is None:
            out.append(f"N={n}: fastest {best['strategy']}, {best['step_ms']:.2f} ms (fits not judged: give "
                       "device_memory=)")
        else:
            out.append(f"N={n}: the fastest that fits {room}: {best['strategy']}, {best['step_ms']:.2f} ms; fits "
                       f"judged on {FITS_ON[best['fits_on']]}: {fmt_size(best['fits_bytes'], unit)} {unit}")
        ties = [r["strategy"] for r in rows if r.get("tie_fastest")]
        if best is not None and ties:
            from zeroexp.plan.network import MODEL_TIME_ERROR

            out.append(f"N={n}: tied with it (=, within {100 * MODEL_TIME_ERROR[0]:.0f} %, {MODEL_TIME_ERROR[1]}): "
                       + ", ".join(ties))
    return out


def _time_table(records: list[dict[str, Any]]) -> Table:
    first = records[0]
    accum = _accumulation(first)
    recompute = any(r.get("recompute_ms") for r in records)
    table = Table(title=f"Step time on {first['network']} at batch {first['batch_size'] or '?'}{accum} per rank "
                        "(computed)")
    for i, c in enumerate(["strategy", "N", "step ms", *(["recompute ms"] if recompute else []), "comm ms",
                           "exposed comm ms", "tokens/s", "fits", "fastest"]):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in records:
        table.add_row(r["strategy"] + (_REFERENCE if r["reference"] else ""), str(r["world_size"]),
                      f"{r['step_ms']:.2f}", *([f"{r['recompute_ms']:.2f}"] if recompute else []),
                      f"{r['comm_ms']:.2f}", f"{r['exposed_comm_ms']:.2f}", f"{r['tokens_per_s']:,.0f}", _fits(r),
                      "*" if r["fastest"] else "=" if r.get("tie_fastest") else "")
    return table


def _comm_table(records: list[dict[str, Any]], unit: str) -> Table:
    ops = list(dict.fromkeys(op for r in records for op in r["payload_bytes"]))
    table = Table(title=f"Collectives per step per rank: calls and payload S, in {unit}")
    for i, c in enumerate(["strategy", "N", *(f"{op} calls / S" for op in ops), "total S", "total bus"]):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in records:
        table.add_row(r["strategy"], str(r["world_size"]),
                      *(f"{r['counts'][op]} / {fmt_size(r['payload_bytes'][op], unit)}" if op in r["payload_bytes"]
                        else "-" for op in ops),
                      fmt_size(r["payload_total_bytes"], unit), fmt_size(r["bus_total_bytes"], unit))
    return table


def _checkpoint_peak_table(records: list[dict[str, Any]], unit: str) -> Table:
    """Per row and kind: the save's and the load's bytes above each rank's start, device and host
    (``checkpoint[kind]["peaks"]``: zeroexp.plan.core.checkpoint_peak_records)."""
    table = Table(title=f"What a checkpoint's save and load hold, in {unit}")
    for i, c in enumerate(["strategy", "N", "kind", "save: device", "save: host", "load: device", "load: host"]):
        table.add_column(c, justify="left" if i in (0, 2) else "right")

    def size(p: dict[str, Any], host: bool) -> str:
        big, r0 = (p["host_largest_rank_bytes"], p["host_rank0_bytes"]) if host else (p["largest_rank_bytes"],
                                                                                        p["rank0_bytes"])
        if big is None:
            return "-"
        shown = fmt_size(big, unit) + ("" if big == r0 else f" (rank 0 {fmt_size(r0, unit)})")
        return (">= " if p["lower_bound"] and not host else "") + shown

    for r in records:
        for kind in ("full", "sharded"):
            peaks = (r["checkpoint"][kind] or {}).get("peaks")
            if peaks is not None:
                table.add_row(r["strategy"], str(r["world_size"]), kind,
                              *(size(peaks[ph], host) for ph in ("save", "load") for host in (False, True)))
    return table


def _checkpoint_table(records: list[dict[str, Any]], unit: str) -> Table:
    """Per row: the state a checkpoint holds, what rank 0 writes for ``full``, what ``sharded`` writes in all and per
    rank (``checkpoint`` of each record: zeroexp.plan.core.checkpoint_record)."""
    table = Table(title=f"What a checkpoint writes, in {unit}")
    for i, c in enumerate(["strategy", "N", "state", "full: rank 0", "sharded: all ranks", "largest rank",
                           "mean rank"]):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in records:
        ck = r["checkpoint"]
        sharded = ck["sharded"] or {}
        size = (lambda key: "-" if sharded.get(key) is None else fmt_size(sharded[key], unit))  # noqa: E731
        table.add_row(r["strategy"], str(r["world_size"]), fmt_size(ck["state_bytes"], unit),
                      fmt_size(ck["full"]["rank0_bytes"], unit), size("written_bytes"), size("largest_rank_bytes"),
                      size("mean_rank_bytes"))
    return table
