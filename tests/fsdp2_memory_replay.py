"""PyTorch's FSDP2 memory test replayed on CPU: test/distributed/_composable/fsdp/test_fully_shard_memory.py's
``_test_fully_shard_training_memory`` (tests/test_plan_cuda.py ``PYTORCH_TEST``), rank 0 of 2 under torch's fake
process group (every collective returns at once, with no backend copy and no worker thread holding a tensor: the
figures do not depend on timing), with the CUDA caching allocator's active bytes replaced by the bytes of the tensor
storages the step allocates (a dispatch mode). Both ranks of PyTorch's test hold as much (every dim 0 is even). Run
by tests/test_pytorch_fsdp2_budgets.py in a forked process; it writes its figures as JSON."""

from __future__ import annotations

import functools
import json
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist

from zeroexp._lib.dispatch import dispatch_mode_base
from zeroexp._lib.storages import storage_address

#: PyTorch's subtests in its order (``run_subtests`` over reshard_after_forward [True, False], use_cpu_offload
#: [True, False], run_optim_in_backward [True, False]), less those it skips and the CPU-offload one (run first there):
#: it keeps its state on the host, which a CPU replay cannot tell from the device, and leaves the device nearly empty.
ORDER = ((True, True), (True, False), (False, False))  # (reshard_after_forward, run_optim_in_backward)


class LiveBytes(dispatch_mode_base()):
    """The bytes of the storages born while counting, alive now, and their peak since the last ``reset_peak``: what
    ``torch.cuda.memory_stats()``'s ``active_bytes.all.current`` and ``.peak`` count of a CUDA step. A storage's size
    is read after every op (FSDP2 frees and regrows its unsharded storages with ``UntypedStorage.resize_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.host: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # born while paused: never counted
        self.counting, self.peak = True, 0
        self.tags: dict[int, str] = {}  # a counted storage's subtest
        self.tag, self.peak_by_tag = "", {}

    def current(self) -> int:
        return sum(s.nbytes() for s in list(self.storages.values()))

    def reset_peak(self) -> None:
        self.peak = self.current()
        self.peak_by_tag = self.by_tag()

    def by_tag(self) -> dict[str, int]:
        """The bytes alive now by the subtest each storage was born in."""
        out: dict[str, int] = {}
        for a, s in list(self.storages.items()):
            out[self.tags[a]] = out.get(self.tags[a], 0) + s.nbytes()
        return out

    @contextmanager
    def paused(self):
        """Storages born here are not counted: PyTorch's model is built on the host before ``fully_shard``."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _plain(out if isinstance(out, (tuple, list)) else (out,)):
            st = t.untyped_storage()
            if not self.counting:
                self.host.setdefault(storage_address(st), st)
            elif storage_address(st) not in self.host and storage_address(st) not in self.storages:
                self.storages[storage_address(st)] = st
                self.tags[storage_address(st)] = self.tag
        now = self.current()
        if now > self.peak:
            self.peak, self.peak_by_tag = now, self.by_tag()
        return out


def _plain(tensors) -> list[torch.Tensor]:
    """The plain tensors holding the data of ``tensors``: a wrapper subclass (DTensor) reports its logical size and
    holds none of its own; its inner tensors (``__tensor_flatten__``, the subclass protocol) were made inside its
    dispatch, where this mode does not see them."""
    out = []
    for t in tensors:
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            out.append(t)
        elif isinstance(t, torch.Tensor) and hasattr(t, "__tensor_flatten__"):
            out += _plain([getattr(t, a) for a in t.__tensor_flatten__()[0]])
    return out


def _register_optim_in_backward(model: torch.nn.Module, **optim_kwargs) -> None:
    """PyTorch's ``_register_optim_in_backward``, as written there."""
    param_to_optim = {}
    for param in model.parameters():
        param_to_optim[param] = torch.optim.AdamW([param], **optim_kwargs)

    def optim_hook(param: torch.nn.Parameter) -> None:
        param_to_optim[param].step()
        param_to_optim[param].zero_grad()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(optim_hook)


def subtest(live: LiveBytes, reshard_after_forward: bool, run_optim_in_backward: bool) -> dict[str, int]:
    """One of PyTorch's subtests (no CPU offload), its measurements in bytes where it reads them (MB there)."""
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

    live.tag = f"reshard_after_forward={reshard_after_forward} run_optim_in_backward={run_optim_in_backward}"
    torch.manual_seed(42)
    lin = torch.nn.Linear(768, 768)  # PyTorch's cuBLAS workspace pre-run: its tensors count on CUDA as here
    inp = torch.randn(2, 768)
    lin(inp).sum().backward()
    base = live.peak
    with live.paused():
        model = Transformer(ModelArgs(vocab_size=32, n_layers=3, dim=768, n_heads=12, weight_tying=False))
    fully_shard_fn = functools.partial(fully_shard, reshard_after_forward=reshard_after_forward)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard_fn(module)
    fully_shard_fn(model)
    optim_kwargs = {"lr": 1e-2, "foreach": False}
    if run_optim_in_backward:
        _register_optim_in_backward(model, **optim_kwargs)
    else:
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    inp = torch.randint(0, 32, (1, 4))
    loss = model(inp)
    forward, forward_by_subtest = live.peak, live.peak_by_tag
    loss.sum().backward()
    backward = live.peak
    del loss
    live.reset_peak()
    if not run_optim_in_backward:
        optim.step()
    optimizer = live.peak
    if not run_optim_in_backward:
        optim.zero_grad()
    live.reset_peak()
    return {"base": base, "forward": forward, "backward": backward, "optimizer": optimizer, "zero_grad": live.peak,
            "forward_by_subtest": forward_by_subtest}


def replay(_rank: int, out: str) -> None:
    """PyTorch's ``False`` subtest alone (a fresh count, as a fresh process's CUDA statistics), then the subtests in
    PyTorch's order (one count across them, as PyTorch never resets its peak between subtests); ``_rank``: the index
    ``torch.multiprocessing.start_processes`` passes."""
    import gc

    dist.init_process_group("fake", rank=0, world_size=2)  # no store: torch makes the fake backend's own
    torch.set_num_threads(1)
    result = {}
    with LiveBytes() as live:
        result["alone"] = subtest(live, False, False)
    gc.collect()  # the run alone's model (FSDP2 keeps reference cycles) is gone before the count in order starts
    with LiveBytes() as live:
        result["in_order"] = [{"reshard_after_forward": r, "run_optim_in_backward": o, **subtest(live, r, o)}
                              for r, o in ORDER]
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)
