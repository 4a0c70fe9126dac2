"""What the device a rank runs on changes in its memory, beside the strategy: the peak model's device semantics.

A CPU cell (gloo) and a CUDA cell (NCCL) run the same strategy code with other defaults and other backends:

- torch's AdamW steps CUDA tensors with its ``foreach`` implementation (torch/optim/optimizer.py
  ``_default_to_fused_or_foreach``: foreach when every tensor is on a CUDA device), whose ``_foreach_sqrt`` list of
  every parameter's size is alive at once; on the CPU it steps one tensor at a time (``adamw_temporaries``).
- gloo copies a collective's input and hands a reduce-scatter's result back in a copy; NCCL works on the tensors
  in place (the peak model's ``gloo`` terms, and the late frees it names on the CPU only).
- torch gives each thread that runs a cuBLAS matmul one workspace from the caching allocator, held from its first
  matmul on (aten/src/ATen/cuda/CublasHandlePool.cpp ``parseChosenWorkspaceSize``): 4096 KiB x 2 + 16 KiB x 8 =
  8,519,680 bytes, or 32 MiB on compute capability 9.x, 10.x and 12.x (Hopper, Blackwell), unless
  ``CUBLAS_WORKSPACE_CONFIG`` says otherwise; a training step runs matmuls on two threads, the forward's and
  autograd's backward thread, so its steady state holds two.

Reserved memory (``max_memory_reserved``, what decides an out-of-memory error) is the caching allocator's
(zeroexp.formulas.peak.allocator): its rounding, pools and segments over the peak model's live bytes.

Allocated bytes on CUDA count each allocation in 512-byte blocks (``torch.cuda.memory_allocated`` counts the caching
allocator's rounded blocks: a 4-byte loss is 512 B): ``block`` is the unit every storage of the traced step is counted
in (the step tracer rounds each one, as torch's MemTracker does for CUDA storages) and every tensor the closed-form
terms of FSDP, DDP and zeroexp's ZeRO add. Not modelled on CUDA (named where the figures are shown): the blocks on
DeepSpeed's rows (their trace and closed-form terms count tensor bytes), what CUDA's kernels allocate beyond the CPU
kernels the step is traced with (PyTorch's test Transformer at dim 32, 4 heads of 8: backward 91,648-131,584 B above
the prediction on an H200, where at dim 256 it is within 512 B), the allocator's fragmentation beyond its rounding and
segments (the order of a phase's requests), DeepSpeed's fused optimizers, and the side streams. NCCL's buffers and the
CUDA context, outside the allocator, are the device's terms beside it (:mod:`zeroexp.formulas.device_memory`):
``nvidia-smi`` shows all three. A block freed on a collective's stream
returns to that stream's free blocks (the allocator keys its free blocks by stream): FSDP1 allocates each all-gather's
output on its all-gather stream, frees it after the unit's compute and rate-limits the gathers in flight to two
(``limit_all_gathers``: the CPU waits on the oldest free event); FSDP2 allocates its all-gather outputs on its copy-in
stream and its reduce-scatter inputs on the compute stream, and guards them with events, not ``record_stream``
(``AllGatherState``: the previous all-gather's output, held by reference through the next unit's copy-out;
``reduce_scatter_states``). Allocated and active bytes, the peak model's, count each buffer while a reference holds
it, as on the CPU; what the streams add to reserved (free blocks one stream cannot hand another, a free delayed to an
event while the CPU runs ahead) is not modelled: the model takes one stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from zeroexp.formulas.device_memory import NcclSettings, NcclTopology
from zeroexp.formulas.peak.allocator import MIN_BLOCK

__all__ = ["DeviceSemantics", "CPU", "FAKE_GROUP", "cuda", "cublas_workspace_bytes", "CUDA_NOT_MODELLED", "measured_on"]

#: torch's default cuBLAS workspace per handle before Hopper: ``:4096:2:16:8`` (KiB x count pairs).
PRE_HOPPER_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8
#: ... and on compute capability 9.x, 10.x, 12.x.
HOPPER_WORKSPACE = 4096 * 8 * 1024
#: The threads of a training step that run matmuls, each with its own cuBLAS handle and workspace.
TRAINING_HANDLES = 2
CUDA_NOT_MODELLED = ("the 512-B blocks on DeepSpeed's rows (their trace and closed-form terms count tensor bytes)",
                     "what CUDA kernels allocate beyond the CPU trace (PyTorch's test Transformer at dim 32: backward "
                     "91,648-131,584 B above the prediction on an H200; at dim 256 within 512 B)",
                     "the caching allocator's fragmentation beyond its rounding and segments",
                     "NCCL's host-side state and a one-rank group's communicator",
                     "the side streams' own free blocks and the frees they delay to an event",
                     "DeepSpeed's fused optimizers")


def cublas_workspace_bytes(capability: float | None) -> int:
    """torch's default cuBLAS workspace for one handle on a GPU of compute ``capability`` (e.g. 7.0, 9.0; None: a
    GPU before Hopper)."""
    return HOPPER_WORKSPACE if capability is not None and int(capability) in (9, 10, 12) else PRE_HOPPER_WORKSPACE


@dataclass(frozen=True)
class DeviceSemantics:
    """``name``: cpu | cuda; ``foreach``: AdamW's foreach update (else single-tensor), or the path a cell sets
    (``optimizer.impl``: ``"single"``, ``"foreach"``, ``"fused"``, :meth:`with_adamw`); ``gloo``: the backend copies
    collectives' inputs and outputs (gloo) or works in place (NCCL); ``workspace_bytes``: what the steady state holds
    beside the model's state (cuBLAS workspaces); ``not_modelled``: what the peak model leaves out on it; ``block``:
    the bytes each allocation is counted in (:func:`zeroexp.formulas.peak.allocator.counted`); on CUDA
    ``expandable_segments`` (the caching allocator's mode), ``nccl_topology`` (None: unknown, no NCCL term) and
    ``nccl`` (NCCL's settings) size the communicators' buffers, ``context_bytes`` the CUDA context (None: unknown)."""

    name: str
    foreach: bool | str
    gloo: bool
    workspace_bytes: int = 0
    not_modelled: tuple[str, ...] = ()
    block: int = 1
    expandable_segments: bool = False
    nccl_topology: NcclTopology | None = None
    nccl: NcclSettings = field(default_factory=NcclSettings)
    context_bytes: int | None = None

    def with_adamw(self, impl: str | None) -> DeviceSemantics:
        """These semantics with AdamW's update path ``impl`` (a cell's ``optimizer.impl``; None: the device's)."""
        return self if impl is None else replace(self, foreach=impl)


CPU = DeviceSemantics("cpu", foreach=False, gloo=True)
#: A dry run's one CPU process under the fake process group, which makes no backend buffer.
FAKE_GROUP = DeviceSemantics("cpu", foreach=False, gloo=False, not_modelled=("the backend's own buffers",))


def cuda(capability: float | None = None, expandable_segments: bool = False, nccl_topology: NcclTopology | None = None,
         nccl: NcclSettings | None = None, context_bytes: int | None = None) -> DeviceSemantics:
    """A CUDA rank of compute ``capability`` (None: before Hopper) with NCCL: the caching allocator in its
    ``expandable_segments`` mode or not, NCCL on ``nccl_topology`` with ``nccl`` settings, a context of
    ``context_bytes``."""
    return DeviceSemantics("cuda", foreach=True, gloo=False,
                           workspace_bytes=TRAINING_HANDLES * cublas_workspace_bytes(capability),
                           not_modelled=CUDA_NOT_MODELLED, block=MIN_BLOCK, expandable_segments=expandable_segments,
                           nccl_topology=nccl_topology, nccl=nccl or NcclSettings(), context_bytes=context_bytes)


def measured_on(source: str, capability: float | None = None, fake_group: bool = False) -> DeviceSemantics:
    """The device semantics of the memory probe's ``source``: a CPU cell's MemTracker (gloo; ``fake_group``: a rank
    played with real tensors under the fake process group, no backend copies), the CUDA caching allocator's (NCCL or
    the fake group alike: no copies; AdamW's foreach; the GPU's cuBLAS workspaces, of its compute ``capability``, are
    in the measured steady state), a dry run's simulation (the fake process group)."""
    if source.startswith("torch.distributed._tools.MemTracker"):
        return FAKE_GROUP if fake_group else CPU
    return cuda(capability) if source.startswith("torch.cuda") else FAKE_GROUP
