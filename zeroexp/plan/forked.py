"""Independent traces side by side: :func:`fork_map` runs ``fn`` on each item, the first in this process and each
other in a forked child, where this process may run on more than one core.

The planner's fake-tensor traces of a deep stack (``zeroexp.plan.steptrace.trace_steps_of``: the same step at three
shallow depths) are pure Python on one core each and independent: on two cores the three take about half their time
one after another (benchmarks/recommend.py). A child inherits everything the parent built (the model's classes, the
invocation's memo) by ``fork``: nothing of the work is pickled but each result. A child runs with one compute thread
(it may inherit an OpenMP pool it cannot use after a fork, as torch's DataLoader workers), writes only its pickled
result to a pipe, and ends by ``os._exit`` (no teardown, no atexit handler of the parent). A child that raises, dies
or sends a result that does not unpickle, or is not done long after this process's own item (:data:`WAIT_TIMES`), is
not trusted: its item is run again in this process, where an exception propagates with its own traceback. On one
core, where ``fork`` is missing, or for a single item, every item runs here, in order.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
from typing import Callable, Iterable, TypeVar

from zeroexp.devices import usable_cores

__all__ = ["fork_map"]

#: How long a child is waited for once this process has computed the first item: that item's time this many times
#: (the items are alike: the same step at another depth), and at least this many seconds; then it is killed and its
#: item computed here (a child stuck on a lock another thread held at the fork must not hang the answer).
WAIT_TIMES, WAIT_AT_LEAST_S = 4.0, 30.0

T = TypeVar("T")
R = TypeVar("R")


def fork_map(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(x) for x in items]``, the items after the first each in a forked child where there are cores to run
    them side by side (see the module)."""
    items = list(items)
    if len(items) < 2 or usable_cores() < 2 or not hasattr(os, "fork"):
        return [fn(x) for x in items]
    children = [_start(fn, x) for x in items[1:]]
    began = time.monotonic()
    first = fn(items[0])
    wait_s = max(WAIT_AT_LEAST_S, WAIT_TIMES * (time.monotonic() - began))
    return [first, *(_result(fn, x, child, wait_s) for x, child in zip(items[1:], children))]


def _start(fn: Callable[[T], R], item: T) -> tuple[int, int] | None:
    """A child computing ``fn(item)``: its pid and the pipe it writes its pickled result to (None: no child)."""
    try:
        read, write = os.pipe()
        pid = os.fork()
    except OSError:
        return None
    if pid:
        os.close(write)
        return pid, read
    status = 1
    try:  # the child: one thread, silent, its result pickled to the pipe, no teardown
        os.close(read)
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        sys.stdout = sys.stderr = open(os.devnull, "w")  # new streams: no lock another thread held at the fork
        import torch

        torch.set_num_threads(1)
        data = pickle.dumps(fn(item), protocol=pickle.HIGHEST_PROTOCOL)
        with os.fdopen(write, "wb") as out:
            out.write(data)
        status = 0
    finally:
        os._exit(status)


def _result(fn: Callable[[T], R], item: T, child: tuple[int, int] | None, wait_s: float) -> R:
    """The child's result, or ``fn(item)`` computed here where the child gave none within ``wait_s`` seconds from
    now (see the module)."""
    if child is None:
        return fn(item)
    pid, read = child
    chunks, deadline = [], time.monotonic() + wait_s
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)  # stuck: not trusted
                chunks = []
                break
            chunk = pipe.read(1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    if status == 0 and data:
        try:
            return pickle.loads(data)
        except Exception:  # noqa: BLE001 - a broken result is recomputed here, where its error would show
            pass
    return fn(item)
