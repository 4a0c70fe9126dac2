"""The calibration's table (rich) and its plot: bus bandwidth against message size, one line per op."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeroexp.results.calibration import Calibration

__all__ = ["render_table", "write_plot"]


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.0f} GiB"


def render_table(cal: Calibration, console: Any) -> None:
    """Per op: the fitted latency and bus bandwidth, the measured busbw at the smallest and largest size; then the
    compute rates."""
    from rich.table import Table

    d = cal.data
    t = Table(title=f"collectives: {d['backend']} on {d['device']}, N={d['world_size']}, {d['machine']['hostname']} "
                    f"(measured; fit t = alpha + S x bus factor / busbw)")
    for col in ("op", "alpha (fit)", "busbw (fit)", "sizes", "busbw smallest", "busbw largest"):
        t.add_column(col, justify="left" if col == "op" else "right")
    for op, e in d["collectives"].items():
        rows, fit = e["sizes"], e["fit"]
        t.add_row(op, f"{fit['alpha_s'] * 1e6:.1f} us", f"{fit['busbw_Bps'] / 1e9:.3f} GB/s",
                  f"{_size(rows[0]['bytes'])} .. {_size(rows[-1]['bytes'])} ({len(rows)})",
                  f"{rows[0]['busbw_Bps'] / 1e9:.4f} GB/s", f"{rows[-1]['busbw_Bps'] / 1e9:.3f} GB/s")
    console.print(t)
    c = d["compute"]
    u = Table(title=f"compute: {c['model']} ({c['numel']:,} parameters), batch {c['batch_size']} per rank, "
                    f"{d['threads_per_rank']} thread(s) per rank (measured, median of {c['steps']} steps)")
    for col in ("phase", "ms", "rate"):
        u.add_column(col, justify="left" if col == "phase" else "right")
    for label, phase in (("forward (+ loss)", "forward"), ("backward", "backward")):
        call = c.get(f"{phase}_call_s", 0.0)
        split = (f" ({c[f'{phase}_call_fixed_s'] * 1e3:.3f} ms + {c['ops'][phase]} operators x "
                 f"{c[f'{phase}_s_per_op'] * 1e6:.2f} us + {c[f'{phase}_call_s_per_param'] * 1e12:.1f} ps per "
                 "parameter)" if f"{phase}_s_per_op" in c else "")
        u.add_row(label, f"{c[f'{phase}_s'] * 1e3:.3f}", f"{call * 1e3:.3f} ms a call{split} + "
                                                          f"{c[f'{phase}_s_per_param_sample'] * 1e12:.2f} ps per "
                                                          "parameter x sample")
    u.add_row("AdamW step", f"{c['optimizer_s'] * 1e3:.3f}",
              (f"{c['adamw_step_s'] * 1e3:.3f} ms + {c['tensors']} tensors x {c['adamw_s_per_tensor'] * 1e6:.1f} us + "
               if "adamw_step_s" in c else "") + f"{c['adamw_s_per_element'] * 1e9:.3f} ns per element"
              + (f" ({c['adamw_cache_elements']:,} in the cache), {c['adamw_s_per_element_beyond'] * 1e9:.3f} beyond"
                 if c.get("adamw_cache_elements") else ""))
    console.print(u)
    for phase, how in (c.get("fit") or {}).items():
        console.print(f"compute fit, {phase}: {how} (" + ", ".join(
            f"{p[f'{phase}_s'] * 1e3:.3f} ms at {p['batch_size']}" for p in c.get("points", [])) + ")")
    _operations(c, console)

    f = d["framework"]
    v = Table(title="framework per step (measured differences, zeroexp.calibrate.framework)")
    for col in ("primitive", "value"):
        v.add_column(col, justify="left" if col == "primitive" else "right")
    v.add_row("Lightning loop, per step", f"{f['loop_s'] * 1e3:.3f} ms")
    for key, what in (("ddp_bucket_s", "DDP, per bucket"),
                      ("zro_broadcast_s", "ZeroRedundancyOptimizer, per broadcast"),
                      ("fsdp1_call_s", "FSDP1, per all_gather / reduce_scatter"),
                      ("fsdp1_orig_call_s", "FSDP1 with use_orig_params, per all_gather / reduce_scatter"),
                      ("fsdp2_call_s", "FSDP2, per all_gather / reduce_scatter")):
        if key in f:
            per_byte = f.get(f"{key}_per_byte")
            v.add_row(what, f"{f[key] * 1e3:.3f} ms" + (f" + {per_byte * 1e12:.1f} ps per byte of the call"
                                                          if per_byte is not None else ""))
    if "dtensor_param_step_s" in f:
        v.add_row("AdamW step, per DTensor parameter (thread CPU)", f"{f['dtensor_param_step_s'] * 1e6:.1f} us")
    if "deepspeed_step_s" in f:
        ds, per_byte = f["deepspeed_step_s"], f.get("deepspeed_step_s_per_byte")
        v.add_row("DeepSpeed ZeRO-1/2 engine, per step",
                  f"not calibrated: {f.get('raw', {}).get('deepspeed', 'unknown')}" if ds is None else
                  f"{ds * 1e3:.3f} ms + {(per_byte or 0.0) * 1e12:.1f} ps per byte of the model's fp32 parameters")
    v.add_row("copy between warm buffers", f"{f['copy_s_per_byte'] * 1e12:.1f} ps per byte")
    console.print(v)
    w = d.get("wake")
    if w:
        x = Table(title=f"waking: a {_size(w['bytes'])} {w['op']} after compute, less one from a barrier (measured, "
                        f"trimmed mean of {w['calls']} calls a gap)")
        for col in ("compute before the call", "call", "extra"):
            x.add_column(col, justify="right")
        for gap, mean, extra in zip(w["gaps_s"], w["mean_s"], w["extra_s"]):
            x.add_row(f"{gap * 1e3:g} ms", f"{mean * 1e3:.3f} ms", f"{extra * 1e3:+.3f} ms")
        console.print(x)
    console.print(f"overlap: {'possible' if d['overlap']['possible'] else 'none'} ({d['overlap']['why']})")


def _operations(c: dict[str, Any], console: Any) -> None:
    """The op-level compute's microbenchmarks (schema 10, and 11's tables): a few of the matmul grid's shapes and of
    the memory-bound op's sizes, each a call's time and its rate, the largest size of each pointwise operation and
    the attention kernel at the longest sequence (schema 11; its FLOPs as the traced step counts them: torch's flop
    counter's, halved where causal), and the operator stacks' dispatch."""
    from rich.table import Table

    k, dispatch = c.get("kernels"), c.get("dispatch")
    if not k or not dispatch:
        return
    o = Table(title="operations (measured, a call each, every rank at once; zeroexp.calibrate.kernels): the op-level "
                    "compute of any model's traced step")
    for col in ("operation", "us a call", "rate"):
        o.add_column(col, justify="left" if col == "operation" else "right")
    dims, grid = k["matmul"]["dims"], k["matmul"]["seconds"]
    top = len(dims) - 1
    for i, j, m in ((0, 0, 0), (1, top, top), (top, top, 1), (top - 1, top - 1, top - 1), (top, top, top)):
        sec = grid[i][j][m]
        o.add_row(f"{k['matmul']['op']} {dims[i]} x {dims[j]} x {dims[m]}", f"{sec * 1e6:.1f}",
                  f"{2 * dims[i] * dims[j] * dims[m] / sec / 1e9:.2f} GFLOP/s")
    for nbytes, sec in list(zip(k["memory"]["bytes"], k["memory"]["seconds"]))[::3]:
        o.add_row(f"{k['memory']['op']}, {_size(nbytes)} moved", f"{sec * 1e6:.1f}", f"{nbytes / sec / 1e9:.2f} GB/s")
    for name, t in sorted((k.get("pointwise") or {}).items()):  # schema 11: the largest size of each
        o.add_row(f"{name}, {_size(t['bytes'][-1])} moved", f"{t['seconds'][-1] * 1e6:.1f}",
                  f"{t['bytes'][-1] / t['seconds'][-1] / 1e9:.2f} GB/s")
    att = k.get("attention")
    if att:  # schema 11: the longest sequence at each head dimension
        from zeroexp._lib.flop_counts import attention_flops
        from zeroexp.formulas.time.kernels import ATTENTION_CALLS

        for name, backward, causal in sorted(c for c in ATTENTION_CALLS if c[0] in att["seconds"]):
            s, h = att["seq"][-1], att["heads"][-1]
            for d, sec in zip(att["head_dim"], att["seconds"][name][-1][-1]):
                shape = (1, h, s, d)
                flops = attention_flops(shape, shape, shape, shape if backward else None) / (2 if causal else 1)
                o.add_row(f"{name} {h} x {s} x {d}", f"{sec * 1e6:.1f}", f"{flops / sec / 1e9:.2f} GFLOP/s")
    for phase in ("forward", "backward"):
        d = dispatch[phase]
        o.add_row(f"{phase}'s dispatch (operator stacks)", f"{d['fixed_s'] * 1e6:.1f} + per operator",
                  f"{d['s_per_op'] * 1e6:.2f} us an operator")
    console.print(o)


def write_plot(cal: Calibration, path: Path) -> None:
    """busbw (GB/s) against S (log2 axis), measured points and the fit's curve, per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zeroexp.formulas import collective_seconds

    fig, ax = plt.subplots(figsize=(7, 4.2))
    n = cal.world_size
    for op, e in cal.data["collectives"].items():
        xs = [r["bytes"] for r in e["sizes"]]
        line, = ax.plot(xs, [r["busbw_Bps"] / 1e9 for r in e["sizes"]], "o", ms=3, label=f"{op} (measured)")
        fit = [s * (r["busbw_Bps"] / (r["bytes"] / r["seconds"])) / collective_seconds(op, s, n, cal.link(op)) / 1e9
               for s, r in zip(xs, e["sizes"])]
        ax.plot(xs, fit, "-", color=line.get_color(), lw=1, alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size S (bytes, nccl-tests convention)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{cal.data['backend']} {cal.data['device']} N={n}: busbw (points measured, lines the fit)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
