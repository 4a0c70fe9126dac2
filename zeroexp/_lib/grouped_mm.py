"""A meta kernel of ``aten._grouped_mm`` for every floating dtype (torch 2.13's, in ``torch._meta_registrations``,
checks CUDA's bf16-only rule, so an fp32 or fp16 mixture-of-experts model -- transformers' fused experts call
``torch._grouped_mm`` -- cannot be traced on the meta device or on fake tensors, while the CPU kernel runs it). The
output is torch's own (``_create_grouped_mm_output_tensor``, private: shape, dtype and, on a CUDA build, its padded
strides); the operands must share one floating dtype. A leaf: it imports nothing of zeroexp."""

from __future__ import annotations

from typing import Any

__all__ = ["install_grouped_mm_meta", "grouped_mm_op"]

#: The library holding the registration (kept alive: a dropped Library unregisters its kernels).
_LIBRARY: list[Any] = []


def install_grouped_mm_meta() -> bool:
    """Register the dtype-agnostic meta kernel of ``aten._grouped_mm`` (idempotent); False where torch has no such
    op."""
    if _LIBRARY:
        return True
    import torch

    if not hasattr(torch.ops.aten, "_grouped_mm"):
        return False
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    def grouped_mm_meta(mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
        torch._check(mat_a.dtype == mat_b.dtype and mat_a.dtype.is_floating_point,
                     lambda: f"_grouped_mm: operands of one floating dtype, got {mat_a.dtype} and {mat_b.dtype}")
        torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                     lambda: f"_grouped_mm: 2-D or 3-D operands, got {mat_a.dim()}-D and {mat_b.dim()}-D")
        return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)

    library = torch.library.Library("aten", "IMPL")
    library.impl("_grouped_mm", grouped_mm_meta, "Meta")
    _LIBRARY.append(library)
    return True


def grouped_mm_op() -> Any:
    """The ``aten._grouped_mm`` operator (a FLOP counter's key: torch 2.13's registry lacks it); None where torch has
    no such op."""
    import torch

    return torch.ops.aten._grouped_mm if hasattr(torch.ops.aten, "_grouped_mm") else None
