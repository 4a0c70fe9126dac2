"""``zeroexp.plan.forked.fork_map``: the items after the first each in a forked child where there are two cores,
the results in the items' order and equal to computing them here; a child that raises, dies or hangs is not trusted (its
item is computed again here, where an error shows with its traceback); on one core everything runs here. The
traces it runs side by side are checked equal to whole traces in tests/test_stack.py."""

from __future__ import annotations

import os
import time

import pytest

import zeroexp.plan.forked as forked
from zeroexp.devices import usable_cores
from zeroexp.plan.forked import fork_map


def test_the_items_run_side_by_side_in_order():
    here = os.getpid()
    out = fork_map(lambda x: (x * x, os.getpid()), range(4))
    assert [v for v, _ in out] == [0, 1, 4, 9]
    pids = [pid for _, pid in out]
    assert pids[0] == here
    assert (len(set(pids)) == 4) == (usable_cores() >= 2)  # each later item in its own child, where there are cores


def test_on_one_core_every_item_runs_here(monkeypatch):
    monkeypatch.setattr(forked, "usable_cores", lambda: 1)
    here = os.getpid()
    assert fork_map(lambda x: (x, os.getpid()), "ab") == [("a", here), ("b", here)]


@pytest.mark.skipif(usable_cores() < 2, reason="one core: no child is forked")
def test_a_child_that_raises_dies_or_hangs_is_recomputed_here(monkeypatch):
    monkeypatch.setattr(forked, "WAIT_AT_LEAST_S", 1.0)
    here = os.getpid()

    def fn(x):
        if os.getpid() != here:
            if x == "raises":
                raise RuntimeError("in the child")
            if x == "dies":
                os._exit(3)
            if x == "hangs":
                time.sleep(600)  # killed once the wait is over
            if x == "unpicklable":
                return lambda: None  # pickling it fails in the child
        return x, os.getpid()

    out = fork_map(fn, ["first", "raises", "dies", "hangs", "unpicklable", "child"])
    assert out[:5] == [("first", here), ("raises", here), ("dies", here), ("hangs", here), ("unpicklable", here)]
    assert out[5][0] == "child" and out[5][1] != here


def test_an_error_shows_as_raised_here():
    def fn(x):
        if x == 2:
            raise ValueError("item 2")
        return x

    with pytest.raises(ValueError, match="item 2"):
        fork_map(fn, [1, 2, 3])


def test_a_deep_stacks_step_traced_side_by_side_is_the_one_traced_here(monkeypatch):
    """The planner's use: a 9-block GPT's step derived from its steps at three depths, traced in children, equals
    the same derived from the three traced here, one after another (and that one the whole step: test_stack.py)."""
    import zeroexp.plan.stack as stack
    from zeroexp.models.gpt import Block
    from zeroexp.plan.steptrace import trace_step_of

    monkeypatch.setattr(stack, "DERIVED_ABOVE", 8)
    cfg = {"_target_": "zeroexp.models.gpt.GPT", "vocab_size": 64, "seq_len": 16, "n_layer": 9, "n_head": 2,
           "n_embd": 32, "bias": True, "tie_weights": True, "input_shape": [16], "dtype": "long", "low": 0, "high": 64,
           "loss": "next_token"}
    forks = []
    real_start = forked._start
    monkeypatch.setattr(forked, "_start", lambda fn, x: forks.append(x) or real_start(fn, x))
    side_by_side = trace_step_of(cfg, 2, [Block], checkpointing=True, root_unit=True)
    assert len(forks) == (2 if usable_cores() >= 2 else 0)  # the depths after the first, each in a child
    monkeypatch.setattr(forked, "usable_cores", lambda: 1)
    assert side_by_side == trace_step_of(cfg, 2, [Block], checkpointing=True, root_unit=True)
