"""The op-level compute on a calibrated machine: the operation microbenchmarks a calibration holds (schema 10 and 11,
``compute.kernels``), how :class:`MeasuredKernels` costs an operation from them, and a cell's and the planner's step
from a model's traced operations. Tables are given (power laws, where the logarithmic interpolation is exact; the
attention table a power law per head plus a constant per call, which its slope over two head counts removes), so
every expected time is computed here from the same law, never one CPU's timing."""

from __future__ import annotations

import math

import pytest

from conftest import HF_LLAMA

from zeroexp.cell.memo import invocation_memo
from zeroexp.formulas.time.kernels import MeasuredKernels, OpCost, ops_seconds

DIMS = (1, 8, 32, 128, 512)
#: a given machine: a matmul call C x m x k x n seconds, an add call A x bytes
C, A = 1e-11, 1e-10
BYTES = tuple(12 * 256 * 4**i for i in range(8))


def _kernels(**dispatch: float) -> MeasuredKernels:
    grid = tuple(tuple(tuple(C * m * k * n for n in DIMS) for k in DIMS) for m in DIMS)
    return MeasuredKernels(DIMS, grid, BYTES, tuple(A * b for b in BYTES), **dispatch)


def _data(**dispatch: float) -> dict:
    k = _kernels()
    return {"kernels": {"dtype": "float32", "matmul": {"op": "torch.mm", "dims": list(DIMS),
                                                       "seconds": [[list(r) for r in p] for p in k.matmul_seconds]},
                        "memory": {"op": "torch.add", "bytes": list(BYTES), "seconds": list(k.memory_seconds)}},
            "dispatch": {p: {"fixed_s": dispatch.get(f"{p}_fixed_s", 0.0), "s_per_op": dispatch.get(f"{p}_s_per_op",
                                                                                                   0.0)}
                         for p in ("forward", "backward")}}


def test_an_operation_costs_its_measured_time_beyond_the_smallest_call():
    k = _kernels()
    base = C  # the 1 x 1 x 1 call: its dispatch, priced per operator apart
    for dims in ((1, 8, 8, 8), (1, 20, 100, 300), (1, 512, 512, 512), (1, 2048, 64, 1024), (6, 17, 33, 90)):
        b, m, kk, n = dims
        op = OpCost("matmul", 2 * b * m * kk * n, 0, dims)
        assert k.seconds(op) == pytest.approx(b * (C * m * kk * n - base), rel=1e-9), dims
    # without its dims (a convolution): the cube of its FLOPs
    assert k.seconds(OpCost("matmul", 2 * 64**3, 0)) == pytest.approx(C * 64**3 - base, rel=1e-9)
    # attention: a matmul of its FLOPs
    assert k.seconds(OpCost("attention", 2 * 100**3, 0)) == pytest.approx(C * 100**3 - base, rel=1e-6)
    # memory-bound: by its bytes, in the table, beyond it (its bandwidth held) and below it (nothing beyond dispatch)
    for nbytes in (BYTES[3], 5 * BYTES[2] + 7, 10 * BYTES[-1]):
        assert k.seconds(OpCost("memory", 0, nbytes)) == pytest.approx(A * (nbytes - BYTES[0]), rel=1e-9)
    assert k.seconds(OpCost("memory", 0, 100)) == 0.0
    by_kind = ops_seconds({OpCost("matmul", 0, 0, (1, 8, 8, 8)): 3, OpCost("memory", 0, BYTES[4]): 2}, k)
    assert by_kind["matmul"] == pytest.approx(3 * C * (512 - 1)) and by_kind["kernels"] == 5
    assert by_kind["memory"] == pytest.approx(2 * A * (BYTES[4] - BYTES[0]))


def test_a_matmul_shaped_otherwise_costs_what_its_shape_measured():
    """A CPU's GEMM rate depends on each dimension: a grid whose narrow n is 4 x slower gives that shape 4 x the
    work of the same FLOPs shaped otherwise (the table, not the FLOPs, decides)."""
    grid = tuple(tuple(tuple(C * m * k * n * (4 if n == 8 else 1) for n in DIMS) for k in DIMS) for m in DIMS)
    k = MeasuredKernels(DIMS, grid, BYTES, tuple(A * b for b in BYTES))
    narrow, wide = (k.seconds(OpCost("matmul", 2 * 512 * 512 * 8, 0, (1, *d))) for d in ((512, 512, 8), (8, 512, 512)))
    assert narrow == pytest.approx(4 * C * 512 * 512 * 8 - C) and wide == pytest.approx(C * 512 * 512 * 8 - C)


#: given pointwise and attention tables (schema 11): gelu P x bytes a call over its own sizes (PBYTES, not the add's);
#: attention per head H x seq^2 x dim, each call F more (its own cost, dispatch), at 8 and 32 heads
P, H, F = 3e-9, 1e-10, 5e-5
PBYTES = tuple(8 * 256 * 4**i for i in range(8))
SEQ, HEAD_DIMS, HEADS = (16, 64, 256), (16, 64, 128), (8, 32)


def _schema11(**dispatch: float) -> MeasuredKernels:
    from dataclasses import replace

    att = tuple((name, tuple(tuple(tuple(F + h * H * s * s * d for d in HEAD_DIMS) for s in SEQ) for h in HEADS))
                for name in ("attention_backward", "attention_forward_causal"))
    return replace(_kernels(**dispatch), pointwise=(("gelu", PBYTES, tuple(P * b for b in PBYTES)),),
                   attention_heads=HEADS, attention_seq=SEQ, attention_dims=HEAD_DIMS, attention_seconds=att)


def test_a_pointwise_operation_costs_its_own_table_and_attention_its_work_per_head():
    """Schema 11: an operation of POINTWISE with a table costs its own time beyond its smallest call (a GELU at P
    seconds a byte, not the add's A); one without a table, or unnamed, the add's. The attention kernel costs the
    slope of its calls over the two head counts (the per-call F is dispatch, not work), at its sequence length and
    head dimension, times its heads, its keys over its queries; beyond the grid, quadratic in the sequence and linear
    in the head dimension; a name the table lacks (forward, not causal) as a square matmul of its FLOPs."""
    k = _schema11()
    nbytes = 5 * BYTES[2] + 7
    assert k.seconds(OpCost("memory", 0, nbytes, name="gelu")) == pytest.approx(P * (nbytes - PBYTES[0]), rel=1e-9)
    for name in ("silu", ""):
        assert k.seconds(OpCost("memory", 0, nbytes, name=name)) == pytest.approx(A * (nbytes - BYTES[0]), rel=1e-9)
    # on the grid, between its points (the GPT's: 32 heads, 32 positions, head dimension 16), beyond it and below it
    for heads, seq, keys, dim in ((32, 64, 64, 64), (12, 64, 64, 16), (4, 256, 256, 128), (48, 1024, 1024, 256),
                                  (8, 64, 128, 64), (32, 32, 32, 16), (8, 32, 32, 32), (6, 100, 100, 80),
                                  (8, 4, 4, 8), (8, 1, 256, 64), (8, 8, 64, 64)):
        work = heads * H * seq * keys * dim
        assert k.seconds(OpCost("attention", 1, 0, (heads, seq, keys, dim), "attention_backward")) == \
            pytest.approx(work, rel=1e-9), (heads, seq, keys, dim)
        assert k.seconds(OpCost("attention", 1, 0, (heads, seq, keys, dim), "attention_forward_causal")) == \
            pytest.approx(work, rel=1e-9)
    square = OpCost("attention", 2 * 100**3, 0, (8, 64, 64, 64), "attention_forward")
    assert k.seconds(square) == pytest.approx(C * 100**3 - C, rel=1e-6)
    assert _kernels().seconds(OpCost("memory", 0, nbytes, name="gelu")) == pytest.approx(A * (nbytes - BYTES[0]))


def test_the_traced_step_names_its_pointwise_operations_and_attention_shapes(compose):
    """The GPT's traced kernels: its GELU and layer norms (forward and backward) and log-softmax named as POINTWISE;
    its attention calls with (batch x heads, queries, keys, head dimension) and their causal names."""
    from zeroexp.formulas.time.kernels import POINTWISE
    from zeroexp.plan.optrace import step_kernels

    cfg = compose("model=gpt", base=("logger=none",)).model
    with invocation_memo(fresh=True):
        forward, backward = step_kernels(cfg, 4, "float32")
    named = {op.name for ops in (forward, backward) for op in ops if op.kind == "memory" and op.name}
    assert {"gelu", "gelu_backward", "native_layer_norm", "native_layer_norm_backward", "_log_softmax",
            "_log_softmax_backward_data"} <= named <= set(POINTWISE)
    head = cfg.n_embd // cfg.n_head
    for ops, name in ((forward, "attention_forward_causal"), (backward, "attention_backward_causal")):
        att = [(op, n) for op, n in ops.items() if op.kind == "attention"]
        assert att and all(op.name == name and op.dims == (4 * cfg.n_head, cfg.seq_len, cfg.seq_len, head)
                           for op, _ in att)
        assert sum(n for _, n in att) == cfg.n_layer


def test_a_calibration_of_schema_10_gives_its_kernels_and_an_older_none():
    from test_time import calibration_data

    from zeroexp.results.calibration import Calibration

    old = Calibration("old", {**calibration_data(), "schema": 9})
    assert old.kernels is None
    data = calibration_data()
    data["compute"].update(_data(forward_fixed_s=2e-4, forward_s_per_op=5e-6, backward_s_per_op=2e-6))
    k = Calibration("new", data).kernels
    assert k == _kernels(forward_fixed_s=2e-4, forward_s_per_op=5e-6, backward_s_per_op=2e-6)
    given = _schema11(forward_fixed_s=2e-4)  # schema 11: the pointwise and attention tables read back as written
    data["compute"]["kernels"].update(
        pointwise={name: {"bytes": list(b), "seconds": list(t)} for name, b, t in given.pointwise},
        attention={"heads": list(HEADS), "seq": list(SEQ), "head_dim": list(HEAD_DIMS),
                   "seconds": {name: [[list(row) for row in grid] for grid in g] for name, g in
                               given.attention_seconds}})
    data["compute"]["dispatch"]["forward"].update(fixed_s=2e-4, s_per_op=0.0)
    data["compute"]["dispatch"]["backward"].update(fixed_s=0.0, s_per_op=0.0)
    assert Calibration("11", {**data, "schema": 11}).kernels == given


def _network(**dispatch: float):
    from test_time import calibration_data

    from zeroexp.plan.network import calibrated_network
    from zeroexp.results.calibration import Calibration

    data = calibration_data()
    data["compute"].update(_data(**dispatch))
    return calibrated_network(Calibration("given", data))


def test_a_step_costs_its_traced_operations_and_their_dispatch(compose):
    """compute_rate on a calibrated machine: per parameter x sample, the traced forward's and backward's work by
    the tables; per call, the stacks' fixed cost and their cost per operator dispatched (even where the calibrated
    model's own fit found no call cost: the old rate's ``*_s_per_op`` are 0 in ``calibration_data``)."""
    from zeroexp.plan.network import compute_rate, model_ops
    from zeroexp.plan.optrace import step_kernels

    net = _network(forward_fixed_s=2e-4, forward_s_per_op=5e-6, backward_fixed_s=3e-4, backward_s_per_op=2e-6)
    cfg = compose("model=gpt", base=("logger=none",)).model
    assert not net.rate.counts_ops
    with invocation_memo(fresh=True):
        ops = model_ops(net, cfg, 4)
        rate = compute_rate(net, cfg, 4, 1000)
        forward, backward = step_kernels(cfg, 4, "float32")
    assert ops[0] > 0 and ops[1] > 0
    work = [sum(v for k, v in ops_seconds(o, net.kernels).items() if k != "kernels") for o in (forward, backward)]
    assert rate.forward_s_per_param_sample * 1000 * 4 == pytest.approx(work[0])
    assert rate.backward_s_per_param_sample * 1000 * 4 == pytest.approx(work[1])
    assert rate.call_seconds("forward", ops[0], 1000) == pytest.approx(2e-4 + 5e-6 * ops[0])
    assert rate.call_seconds("backward", ops[1], 1000) == pytest.approx(3e-4 + 2e-6 * ops[1])


def test_a_steps_time_follows_its_shapes_at_equal_parameters(compose):
    """At equal parameter count (a Llama's rotary positions hold no parameter), a longer sequence costs more work
    and the same operators dispatched; a smaller micro-batch less a call but more a sample (its calls' dispatch
    spread over fewer samples); each as its traced operations' costs say (the sums recomputed here from the traced
    kernels)."""
    from zeroexp.plan.network import compute_rate, model_ops
    from zeroexp.plan.optrace import step_kernels

    net = _network(forward_fixed_s=1e-4, forward_s_per_op=4e-6, backward_fixed_s=1e-4, backward_s_per_op=2e-6)
    llama = (*(o for o in HF_LLAMA if not o.startswith(("model.seq_len", "model.max_position"))),
             "model.max_position_embeddings=64")

    def step(seq: int, batch: int) -> tuple[float, tuple[int, int]]:
        cfg = compose(*llama, f"model.seq_len={seq}", base=("logger=none",)).model
        rate, ops = compute_rate(net, cfg, batch, 1000), model_ops(net, cfg, batch)
        fwd, bwd = step_kernels(cfg, batch, "float32")
        by_ops = sum(v for o in (fwd, bwd) for k, v in ops_seconds(o, net.kernels).items() if k != "kernels")
        assert (rate.forward_s_per_param_sample + rate.backward_s_per_param_sample) * 1000 * batch == \
            pytest.approx(by_ops)
        calls = rate.call_seconds("forward", ops[0], 1000) + rate.call_seconds("backward", ops[1], 1000)
        assert calls == pytest.approx(2e-4 + 4e-6 * ops[0] + 2e-6 * ops[1])
        return by_ops + calls, ops

    with invocation_memo(fresh=True):
        (short, ops_short), (long_, ops_long), (small, _) = step(8, 4), step(32, 4), step(32, 1)
    assert long_ > short and ops_long == ops_short
    assert small < long_ and small / 1 > long_ / 4
    assert math.isfinite(long_)


def test_the_microbenchmarks_time_every_point_on_every_rank(monkeypatch):
    """measure_kernels: a barrier before each point, one all_reduce (MAX) of every point after the timed work; the
    grid cubed and the memory sizes, each a positive time, laid out as a calibration holds them."""
    import torch

    from zeroexp.calibrate import kernels as measure

    barriers, reduced = [], []
    monkeypatch.setattr(measure.dist, "barrier", lambda: barriers.append(1))
    monkeypatch.setattr(measure, "MATMUL_DIMS", (1, 8))
    monkeypatch.setattr(measure, "MEMORY_ELEMENTS", (256, 1024))
    monkeypatch.setattr(measure, "BLOCKS", 3)
    monkeypatch.setattr(measure, "POINTWISE_ELEMENTS", (256, 1024))
    monkeypatch.setattr(measure, "ATTENTION_HEADS", (2, 4))
    monkeypatch.setattr(measure, "ATTENTION_SEQ", (8, 16))
    monkeypatch.setattr(measure, "ATTENTION_DIMS", (4,))

    def all_reduce(t, op=None):
        reduced.append(op)
    monkeypatch.setattr("zeroexp.calibrate.calls.dist.all_reduce", all_reduce)
    out = measure.measure_kernels(torch.device("cpu"))
    assert len(barriers) == 2**3 + 2 + 10 * 2 + 4 * 2 * 2 and len(reduced) == 1
    assert out["matmul"]["dims"] == [1, 8] and len(out["matmul"]["seconds"]) == 2
    assert all(s > 0 for plane in out["matmul"]["seconds"] for row in plane for s in row)
    assert out["memory"]["bytes"] == [12 * 256, 12 * 1024] and all(s > 0 for s in out["memory"]["seconds"])
    from zeroexp.formulas.time.kernels import ATTENTION, POINTWISE

    table = out["pointwise"]
    assert sorted(table) == sorted(POINTWISE) and all(len(t["seconds"]) == 2 and min(t["seconds"]) > 0
                                                      for t in table.values())
    # bytes moved as the traced step counts them: every tensor argument and output (fp32)
    assert table["gelu"]["bytes"] == [8 * 256, 8 * 1024] and table["gelu_backward"]["bytes"] == [12 * 256, 12 * 1024]
    att = out["attention"]
    assert att["heads"] == [2, 4] and att["seq"] == [8, 16] and att["head_dim"] == [4]
    assert sorted(att["seconds"]) == sorted(f"{n}{c}" for n in ("attention_forward", "attention_backward")
                                            for c in ("", "_causal"))
    assert all(len(g) == 2 and all(len(rows) == 2 and all(len(r) == 1 and r[0] > 0 for r in rows) for rows in g)
               for g in att["seconds"].values())
    # each entry is its own call's: the calls numbered in the order they are timed, each number read back where it
    # belongs (matmul grid, add sizes, each pointwise operation's sizes, each attention call's heads x seq x dim)
    calls = iter(range(10**6))
    monkeypatch.setattr(measure, "_per_call", lambda fn, device: float(next(calls)))
    out = measure.measure_kernels(torch.device("cpu"))
    assert out["matmul"]["seconds"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]] and out["memory"]["seconds"] == [8, 9]
    at = 10
    for name in POINTWISE:
        assert out["pointwise"][name]["seconds"] == [at, at + 1], name
        at += 2
    for name in (f"{n}{c}" for n in ATTENTION for c in ("", "_causal")):
        assert out["attention"]["seconds"][name] == [[[at], [at + 1]], [[at + 2], [at + 3]]], name
        at += 4


def test_calibrates_table_shows_the_operations_it_measured():
    """``python -m zeroexp.calibrate``'s console table lists a few of the grid's shapes and sizes, each with its
    rate computed from the file's time, and the stacks' dispatch."""
    import io

    from rich.console import Console

    from zeroexp.calibrate.display import _operations

    data = _data(forward_fixed_s=2e-4, forward_s_per_op=5e-6, backward_s_per_op=2e-6)
    out = io.StringIO()
    _operations(data, Console(file=out, width=200))
    text = out.getvalue()
    top = 2 * 512**3 / (C * 512**3) / 1e9  # GFLOP/s of the 512^3 call on the given machine
    assert "torch.mm 512 x 512 x 512" in text and f"{top:.2f} GFLOP/s" in text
    assert f"{1 / A / 1e9:.2f} GB/s" in text  # every size of the add at A seconds a byte
    assert "4.00 us an operator" not in text and "5.00 us an operator" in text and "2.00 us an operator" in text
    _operations({}, Console(file=io.StringIO()))  # a calibration before schema 10: nothing shown, nothing raised
    given = _schema11()  # schema 11: each pointwise operation at its largest size, attention at the longest sequence
    data["kernels"].update(pointwise={"gelu": {"bytes": list(PBYTES), "seconds": [P * b for b in PBYTES]}},
                           attention={"heads": list(HEADS), "seq": list(SEQ), "head_dim": list(HEAD_DIMS),
                                      "seconds": {n: [[list(r) for r in grid] for grid in g]
                                                  for n, g in given.attention_seconds}})
    out = io.StringIO()
    _operations(data, Console(file=out, width=200))
    text = out.getvalue()
    assert "gelu, 32 MiB moved" in text and f"{1 / P / 1e9:.2f} GB/s" in text
    sec = F + 32 * H * 256**2 * 128  # 4 x heads x seq^2 x dim FLOPs forward, 2.5 x backward, halved where causal
    assert "attention_backward 32 x 256 x 128" in text and f"{10 * 32 * 256**2 * 128 / sec / 1e9:.2f} GFLOP/s" in text
    assert f"{2 * 32 * 256**2 * 128 / sec / 1e9:.2f} GFLOP/s" in text  # attention_forward_causal
