"""ZeRO-1 and ZeRO-2 by hand: flat bucketed shards, reduce_scatter, a local AdamW, all_gather.

Rajbhandari, Rasley, Ruwase, He. "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC'20, arXiv:1910.02054. Section 5.1: P_os (stage 1) partitions the optimizer states (fp32 master copy and
Adam's two moments, K=12 bytes per parameter) over the N data-parallel ranks; P_os+g (stage 2) partitions the
gradients too. Section 7.2.1: the gradients are reduce-scattered, each rank updates its partition, and the
updated parameters are all-gathered: Psi + Psi per step, the volume of one all-reduce.

Layout. The trainable parameters are cut, in definition order, into buckets of at most ``bucket_cap_bytes``
(a parameter is never split; one larger than the cap is a bucket alone). A bucket is one contiguous buffer
in the compute dtype, padded to a multiple of N; the module's parameters are views into it. Rank r owns
elements ``[r*s, (r+1)*s)`` of every bucket (``s = padded / N``): the fp32 master copy of them and AdamW's
moments. The master is a separate fp32 tensor even when the compute dtype is fp32, as DeepSpeed's ZeRO-1/2
keeps ``single_partition_of_fp32_groups``.

One :meth:`ShardedAdamW.step` (one backward per step):

1. per bucket, the flat gradient is reduce-scattered (SUM, in place: shard r of the buffer receives it;
   started asynchronously by a gradient hook as soon as backward has filled the bucket, so that it overlaps
   the rest of backward, as DDP's buckets do) and rank r divides its shard by N in fp32;
   ``reduce="allreduce"`` all-reduces the whole bucket instead (the "naive ZeRO": N times the reduced bytes
   a rank needs);
2. with ``clip_grad_norm`` or loss scaling, one all_reduce of the sum of the shards' squared norms gives
   the global norm (clip coefficient as ``torch.nn.utils.clip_grad_norm_``; non-finite: skip the update);
3. ``torch.optim.AdamW``, unchanged, updates the fp32 master shards;
4. per bucket, the updated shard (cast to the compute dtype) is all-gathered into the bucket: the parameters;
   asynchronously: a forward pre-hook of each module holding the bucket's parameters waits for it, so the
   all_gather overlaps what runs before the next forward reaches the bucket (Megatron-LM's distributed optimizer,
   ``overlap_param_gather``). Anything else reading the parameters between steps calls
   :meth:`ShardedAdamW.wait_for_parameters` first.

Stage 1 keeps the full gradient buffer (``p.grad`` are views into it, zeroed in place by ``zero_grad``).
Stage 2 allocates a bucket's full gradient buffer when backward reaches the bucket (a gradient hook attaches
the views before autograd accumulates), copies the reduced shard r into a kept shard buffer and releases the
full buffer right after the bucket's reduce_scatter: between steps a rank holds 1/N of the gradients,
whenever ``zero_grad`` is called. Every collective here must be entered by every rank, in the same order.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from zeroexp._lib.profiler import profiler_enabled
from zeroexp.formulas import cut_buckets, padded_numel

__all__ = ["Bucket", "DynamicLossScale", "ShardedAdamW", "flatten_into_buckets", "gather_full_masters"]

# torch >= 2.12 renamed the tensor collectives; both take (output, input, ...).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class Bucket:
    """Parameters flattened into one padded buffer, and rank ``rank``'s shard of their optimizer state."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # elements of real parameters; the buffer holds padded_numel(numel, world_size)
    world_size: int
    rank: int
    flat: torch.Tensor  # compute dtype, padded; every parameter is a view into it
    master: torch.Tensor  # fp32 copy of shard ``rank`` of ``flat``
    grad: torch.Tensor | None = None  # stage 1: the full flat gradient; the params' .grad are views into it
    grad_shard: torch.Tensor | None = None  # stage 2: the averaged gradient of shard ``rank``, compute dtype
    ready: int = 0  # parameters whose gradient this backward has accumulated
    work: Any = None  # the bucket's gradient reduction in flight (async), until step waits for it
    gather: Any = None  # the updated parameters' all_gather in flight (async), until the next forward needs them
    gather_input: torch.Tensor | None = None  # its input (the master cast to the compute dtype), alive until then

    @property
    def shard_numel(self) -> int:
        return self.flat.numel() // self.world_size

    @property
    def logical_shard_numel(self) -> int:
        """Elements of real parameters in this rank's shard (the padding sits at the end of the last shards)."""
        return max(0, min(self.shard_numel, self.numel - self.rank * self.shard_numel))

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full bucket-sized tensor (a view)."""
        return full[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]

    def views(self, full: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter and its view, shaped like it, into a full bucket-sized tensor."""
        for p, off in zip(self.params, self.offsets):
            yield p, full[off:off + p.numel()].view_as(p)


def flatten_into_buckets(params: Iterable[nn.Parameter], world_size: int, rank: int, bucket_cap_bytes: int,
                         compute_dtype: torch.dtype) -> list[Bucket]:
    """Move ``params`` into padded flat buckets of ``compute_dtype``; take rank ``rank``'s fp32 master shard.

    The master is copied from the parameters as they are (fp32), before they are cast to ``compute_dtype``,
    so mixed precision starts from the same weights as fp32 training. Afterwards every parameter's ``.data``
    is a view into its bucket's ``flat``.
    """
    params = list(params)
    cut = cut_buckets([p.numel() * compute_dtype.itemsize for p in params], bucket_cap_bytes)  # the planner's cut too
    return [_make_bucket([params[i] for i in bucket], world_size, rank, compute_dtype) for bucket in cut]


def _make_bucket(params: list[nn.Parameter], world_size: int, rank: int, dtype: torch.dtype) -> Bucket:
    offsets = [0]
    for p in params[:-1]:
        offsets.append(offsets[-1] + p.numel())
    numel = offsets[-1] + params[-1].numel()
    with torch.no_grad():
        full32 = torch.zeros(padded_numel(numel, world_size), dtype=torch.float32, device=params[0].device)
        for p, off in zip(params, offsets):
            full32[off:off + p.numel()].copy_(p.detach().reshape(-1))
        bucket = Bucket(params, offsets, numel, world_size, rank, flat=full32.to(dtype), master=torch.empty(0))
        bucket.master = bucket.shard(full32).clone()  # its own storage, also when flat is full32 itself
        for p, view in bucket.views(bucket.flat):
            p.data = view
    return bucket


@dataclass
class DynamicLossScale:
    """fp16 loss scaling: multiply the loss by ``value``; halve it on a non-finite gradient (that step is
    skipped), double it after ``growth_interval`` finite steps (torch.amp.GradScaler's defaults)."""

    value: float = 2.0 ** 16
    growth_interval: int = 2000
    finite_steps: int = 0
    skipped_steps: int = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.value, self.finite_steps, self.skipped_steps = self.value / 2, 0, self.skipped_steps + 1
            return
        self.finite_steps += 1
        if self.finite_steps == self.growth_interval:
            self.value, self.finite_steps = self.value * 2, 0


@dataclass
class _Settings:
    stage: int
    reduce: str
    clip_grad_norm: float | None
    loss_scale: DynamicLossScale | None
    group: Any
    world_size: int


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW over the fp32 master shards of ``buckets``; ``step`` reduces gradients and all-gathers parameters.

    ``param_groups`` hold the module's parameters (what Lightning and LR schedulers look at); their ``lr``,
    ``betas``, ``eps`` and ``weight_decay`` are handed to :attr:`local` (a plain ``torch.optim.AdamW`` over
    the master shards) at every step. ``stage``: 1 or 2 (see the module docstring). ``reduce``:
    ``"reduce_scatter"`` or ``"allreduce"``. ``loss_scale``: fp16 dynamic loss scaling; the caller multiplies
    the loss by ``loss_scale.value`` (:meth:`scale_loss`) before backward. A collective on every call of
    :meth:`step`: call it on every rank.
    """

    def __init__(self, buckets: list[Bucket], *, stage: int, reduce: str = "reduce_scatter",
                 clip_grad_norm: float | None = None, loss_scale: DynamicLossScale | None = None,
                 group: Any = None, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, foreach: bool | None = None, fused: bool | None = None) -> None:
        if stage not in (1, 2) or reduce not in ("reduce_scatter", "allreduce"):
            raise ValueError(f"stage must be 1 or 2 and reduce reduce_scatter or allreduce, got {stage}, {reduce}")
        hyper = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__([p for b in buckets for p in b.params], hyper)
        self.buckets = buckets
        # foreach / fused: the cell's AdamW path (optimizer.impl), of the local AdamW alone
        self.local = torch.optim.AdamW([b.master for b in buckets], **hyper, foreach=foreach, fused=fused)
        # Mutable state lives in objects, never in rebound attributes: Lightning's LightningOptimizer copies
        # this optimizer's __dict__ at wrap time.
        self.taken: dict[str, Any] = {"norm": None, "keep": False}  # the last step's global norm, where kept
        self.settings = _Settings(stage, reduce, clip_grad_norm, loss_scale, group,
                                  buckets[0].world_size if buckets else 1)
        self.micro = {"accumulating": False}  # inside accumulating(): a micro-batch before a step's last
        for b in buckets:
            if stage == 1:  # the full gradient buffer lives as long as the optimizer
                _attach_grad_buffer(b)
            else:  # allocated when backward reaches the bucket, released after its reduce_scatter
                b.grad_shard = torch.zeros(b.shard_numel, dtype=b.flat.dtype, device=b.flat.device)
            for p in b.params:
                if stage == 2:
                    p.register_hook(_attach_on_first_grad(b))
                p.register_post_accumulate_grad_hook(self._reduce_when_full(b))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (fp16), or ``loss`` itself."""
        scale = self.settings.loss_scale
        return loss if scale is None else loss * scale.value

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Stage 1: zero the full gradient buffer in place (the ``.grad`` views stay). Stage 2: zero the
        gradient shard; no full gradient exists until backward reaches the bucket. ``set_to_none`` is ignored."""
        for b in self.buckets:
            b.ready = 0
            if self.settings.stage == 1:
                _attach_grad_buffer(b)
            else:
                b.grad_shard.zero_()
                _release_grad_buffer(b)

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Around a micro-batch before the last of an optimizer step (``grad_accum``). Stage 1: nothing is reduced,
        the full gradient buffer accumulates. Stage 2: the micro-batch's gradient is reduce-scattered as usual
        and its shard added into the gradient shard, the full gradient released (DeepSpeed's ZeRO-2 does the same)."""
        self.micro["accumulating"] = True
        try:
            yield
        finally:
            self.micro["accumulating"] = False
        if self.settings.stage == 2:
            with torch.no_grad():
                for b in self.buckets:
                    if b.work is None:  # backward did not fill it (unused parameters)
                        self._start_reduce(b)
                for b in self.buckets:
                    b.work.wait()
                    b.work, b.ready = None, 0
                    b.grad_shard.add_(b.shard(b.grad))
                    _release_grad_buffer(b, reduced=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (forward and backward), then reduce -> [global norm] -> local AdamW -> all_gather."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        s = self.settings
        divisor = s.world_size * (s.loss_scale.value if s.loss_scale is not None else 1.0)
        for b in self.buckets:  # buckets backward did not fill (unused parameters): reduce them now
            if b.work is None:
                self._start_reduce(b)
        for b in self.buckets:
            b.work.wait()
            b.work, b.ready = None, 0
            shard = b.shard(b.grad)  # the summed gradient of shard r, in the bucket's full gradient buffer
            if s.stage == 2:  # keep the shard (added to the micro-batches' before it), release the full gradient
                shard = b.grad_shard.add_(shard)
                _release_grad_buffer(b, reduced=True)
            b.master.grad = shard.float().div_(divisor)  # fp32 compute: in place, the shard becomes the average
        update = True
        if s.clip_grad_norm is not None or s.loss_scale is not None:
            update = self._global_norm_and_clip()
        if update:
            for group in self.local.param_groups:
                group.update({k: self.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")})
            self.local.step()
        for b in self.buckets:
            if s.stage == 2 and b.master.grad.data_ptr() != b.grad_shard.data_ptr():
                b.grad_shard.copy_(b.master.grad)  # low-precision compute: keep the averaged, clipped shard
            b.master.grad = None
            # Async: the next forward waits for it in a pre-hook of the bucket's modules (wait_for_parameters), so
            # the all_gather overlaps what comes between (as Megatron's overlap_param_gather).
            b.gather_input = b.master if b.flat.dtype == torch.float32 else b.master.to(b.flat.dtype)
            b.gather = _all_gather(b.flat, b.gather_input, group=s.group, async_op=True)
        if profiler_enabled():
            # Under a profiler, an async gloo op ends its profiler record on gloo's worker thread when it completes:
            # left in flight past the profiler's stop, that raced the stop and crashed a rank (SIGSEGV, once in a
            # CI run). Profiled steps therefore wait here; the bytes and calls they record are the same.
            self.wait_for_parameters()
        return loss

    def wait_for_parameters(self, buckets: Iterable[Bucket] | None = None) -> None:
        """Wait for the parameters' all_gather of ``buckets`` (default: every bucket) issued by the last step."""
        for b in self.buckets if buckets is None else buckets:
            if b.gather is not None:
                b.gather.wait()
                b.gather, b.gather_input = None, None

    def overlap_parameter_gather(self, module: nn.Module) -> list[Any]:
        """Forward pre-hooks on every submodule of ``module`` that holds a bucketed parameter itself: before it
        computes, wait for the all_gather of the buckets it reads (a module whose parameters never changed does not
        wait). The handles, to remove them."""
        owner = {id(p): b for b in self.buckets for p in b.params}
        hooks = []
        for sub in module.modules():
            mine = list({id(owner[id(p)]): owner[id(p)] for p in sub.parameters(recurse=False)
                         if id(p) in owner}.values())
            if mine:
                hooks.append(sub.register_forward_pre_hook(lambda m, args, mine=mine: self.wait_for_parameters(mine)))
        return hooks

    def _reduce_when_full(self, b: Bucket) -> Callable[[nn.Parameter], None]:
        """A post-accumulate hook: once backward has accumulated every gradient of the bucket, start its
        reduction, so that it overlaps the rest of backward (one backward per step)."""
        def hook(p: nn.Parameter) -> None:
            if self.micro["accumulating"] and self.settings.stage == 1:
                return  # the buffer accumulates; the step's last micro-batch reduces it
            if b.work is not None:
                raise RuntimeError("a second backward before step: gradient accumulation is not supported")
            b.ready += 1
            if b.ready == len(b.params):
                self._start_reduce(b)

        return hook

    def _start_reduce(self, b: Bucket) -> None:
        """Sum the bucket's gradient over ranks, in place and async: shard ``rank`` of ``b.grad`` receives it."""
        if b.grad is None:  # backward produced no gradient for the bucket
            _attach_grad_buffer(b)
        for p, view in b.views(b.grad):
            if p.grad is None:  # not used in this step's forward
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():  # not a view of the buffer (set by someone else): copy
                view.copy_(p.grad)
            p.grad = view
        group = self.settings.group
        if self.settings.reduce == "allreduce":
            b.work = dist.all_reduce(b.grad, group=group, async_op=True)
        else:  # in place: output = input + rank * shard_numel, as NCCL allows and gloo supports
            b.work = _reduce_scatter(b.shard(b.grad), b.grad, group=group, async_op=True)

    def _global_norm_and_clip(self) -> bool:
        """All-reduce the squared norm of the gradient shards; clip; update the loss scale. False: skip."""
        s = self.settings
        squares = torch.zeros((), dtype=torch.float32, device=self.buckets[0].master.device)
        for b in self.buckets:  # padding holds zero gradients
            squares += b.master.grad.pow(2).sum()
        dist.all_reduce(squares, group=s.group)
        norm = squares.sqrt()
        self.taken["norm"] = norm if self.taken["keep"] else None  # read after the step (step_grad_norm)
        if s.loss_scale is not None:
            finite = bool(torch.isfinite(norm))
            s.loss_scale.update(finite)
            if not finite:
                return False
        if s.clip_grad_norm is not None:  # as torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), at most 1
            coef = torch.clamp(s.clip_grad_norm / (norm + 1e-6), max=1.0)
            for b in self.buckets:
                b.master.grad.mul_(coef)
        return True


def _attach_grad_buffer(b: Bucket) -> None:
    """Zero the bucket's full flat gradient buffer (allocate it if released); make every ``.grad`` a view of it."""
    b.grad = torch.zeros_like(b.flat) if b.grad is None else b.grad.zero_()
    for p, view in b.views(b.grad):
        p.grad = view


def _release_grad_buffer(b: Bucket, reduced: bool = False) -> None:
    """Drop the bucket's full gradient buffer and every ``.grad`` viewing it (stage 2). ``reduced``: its reduction
    was waited for, so its bytes are freed now (the storage resized to 0, as FSDP frees its unsharded buffers): the
    finished work object still references the tensor, and gloo's worker thread drops it at a moment of its own."""
    if reduced and b.grad is not None:
        b.grad.untyped_storage().resize_(0)
    b.grad = None
    for p in b.params:
        p.grad = None


def _attach_on_first_grad(b: Bucket) -> Callable[[torch.Tensor], None]:
    """A gradient hook (it runs before autograd accumulates into ``.grad``): on the bucket's first gradient of a
    backward, allocate its zeroed buffer and attach the views, so that autograd accumulates into the buffer."""
    def hook(grad: torch.Tensor) -> None:
        if b.grad is None:
            _attach_grad_buffer(b)

    return hook


def gather_full_masters(buckets: list[Bucket], group: Any = None) -> dict[nn.Parameter, torch.Tensor]:
    """Every parameter's fp32 master value at full size, all-gathered from the shards (a collective)."""
    full: dict[nn.Parameter, torch.Tensor] = {}
    for b in buckets:
        flat32 = torch.empty(b.flat.numel(), dtype=torch.float32, device=b.master.device)
        _all_gather(flat32, b.master, group=group)
        full.update(b.views(flat32))
    return full
