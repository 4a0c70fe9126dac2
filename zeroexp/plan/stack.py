"""A deep stack of identical blocks traced at two, three and four blocks instead of at its own depth.

A model factory (class or function) may declare ``repeated_blocks = (argument, container)``: its ``argument`` is the
number of blocks the submodule ``container`` holds (``""``: the model itself, an ``nn.Sequential``), run one after
another on the previous block's output, each built alike and none reading its index or the depth (``zeroexp.models.
gpt.GPT``, ``zeroexp.models.lora.lora_gpt``, ``zeroexp.models.LinearStack``). Then a forward at L blocks runs what
comes before the stack, the first block, L - 1 blocks alike each on an input alike, and what comes after the stack
on an output alike, whatever L; a saved tensor is counted for the innermost unit running
(:func:`~zeroexp.plan.activations.trace_activations`), so each record of the trace
(:class:`~zeroexp.plan.activations.ActivationTrace`) is, at L blocks: for a unit at or under block ``<container>.i``
(i >= 1), block 1's record renamed; for any other unit, and for the held bytes, its record at two blocks plus
(L - 2) times its growth from two blocks to three (the blocks' saves outside their own units land in the unit around
the stack, the same for each block). The traces at two and three give the records; the trace at four checks them,
every field and the order of every unit, else the model is traced at its own depth; a stack of at most
:data:`DERIVED_ABOVE` blocks is traced whole, which costs no more (tests/test_stack.py holds
derived traces equal to whole ones on zeroexp's models and stacks of foreign blocks). What it saves: a forward's
fake-tensor trace costs about the same per block whatever the block's width (an 80-block GPT ~0.5 s a batch and dtype
on this host; two to four blocks a few hundredths each). The same declaration derives the planner's step on the meta
device (``zeroexp.plan.shape.derived_units``, by :func:`grow_runs`) and a step's counted FLOPs
(``zeroexp.plan.flops.step_flops``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

__all__ = ["stack_of", "at_depth", "deepen", "derived_trace", "grow_runs", "DERIVED_ABOVE"]

#: A stack is derived only deeper than this: the three shallow traces (nine blocks, three builds) cost about what a
#: whole trace of 20 blocks does (a GPT-2 small of 12 is traced whole).
DERIVED_ABOVE = 20


def stack_of(model_cfg: Mapping[str, Any]) -> tuple[str, str, int] | None:
    """(argument, container, depth) of a model config whose factory declares ``repeated_blocks`` (see the module)
    and gives its depth as an integer above :data:`DERIVED_ABOVE`; None otherwise (traced whole)."""
    from zeroexp.models import import_class

    try:
        declared = getattr(import_class(str(model_cfg["_target_"]), base=None), "repeated_blocks", None)
    except Exception:  # noqa: BLE001 - no factory to read (missing, not importable): no declaration
        return None
    if declared is None:
        return None
    argument, container = declared
    depth = model_cfg.get(argument)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth <= DERIVED_ABOVE:
        return None
    return argument, container, depth


def at_depth(model_cfg: Mapping[str, Any], argument: str, depth: int) -> dict[str, Any]:
    """The model config (resolved, as a plain dict) with ``argument`` set to ``depth``."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(model_cfg, resolve=True) if OmegaConf.is_config(model_cfg) else dict(model_cfg)
    return {**plain, argument: depth}


def _block(name: str, prefix: str) -> tuple[int, str] | None:
    """(index, the rest of the name) of a unit at or under block ``<prefix><index>``; None for any other unit."""
    if not name.startswith(prefix):
        return None
    head, dot, rest = name[len(prefix):].partition(".")
    return (int(head), dot + rest) if head.isdigit() else None


def _grow(two: dict[str, int], three: dict[str, int], depth: int, prefix: str) -> dict[str, int] | None:
    """Records of the two- and three-block traces at ``depth`` blocks: the second block's repeated after it,
    renamed; every other record grown by its three-block record less its two-block one per further block. None
    where ``two`` is not of two blocks, the second block's records are not one run, or the records outside the
    blocks are not the same units in the same order at two and three blocks."""
    items = list(two.items())
    outside = [name for name in two if _block(name, prefix) is None]
    if outside != [name for name in three if _block(name, prefix) is None]:
        return None
    if any((b := _block(name, prefix)) is not None and b[0] > 1 for name in two):
        return None
    where = [i for i, (name, _) in enumerate(items) if (_block(name, prefix) or (None,))[0] == 1]
    if where and where != list(range(where[0], where[-1] + 1)):
        return None
    second = [(_block(name, prefix)[1], v) for name, v in items[where[0]:where[-1] + 1]] if where else []
    more = [(f"{prefix}{k}{rest}", v) for k in range(2, depth) for rest, v in second]
    cut = where[-1] + 1 if where else len(items)
    grown = {name: v if name not in outside else _affine(v, three[name], depth)
             for name, v in items[:cut] + more + items[cut:]}
    return grown if all(v >= 0 for v in grown.values()) else None


def _affine(two: int, three: int, depth: int) -> int:
    return two + (depth - 2) * (three - two)


def deepen(two: Any, three: Any, depth: int, container: str) -> Any:
    """The ``ActivationTrace`` at ``depth`` (>= 2) blocks of ``container`` from the traces at two and three (see the
    module); None where they cannot be grown (:func:`_grow`) or no record is under a block (nothing wrapped under
    the stack: nothing to repeat)."""
    prefix = f"{container}." if container else ""
    units = _grow(two.unit_bytes, three.unit_bytes, depth, prefix)
    inputs = _grow(two.unit_input_bytes, three.unit_input_bytes, depth, prefix)
    if units is None or inputs is None or not any(_block(name, prefix) for name in two.unit_bytes):
        return None
    return replace(two, unit_bytes=units, unit_input_bytes=inputs,
                   held_bytes=_affine(two.held_bytes, three.held_bytes, depth),
                   tensors=_affine(two.tensors, three.tensors, depth))


def _same(a: Any, b: Any) -> bool:
    """Equal traces, the order of their units included."""
    return (a == b and list(a.unit_bytes.items()) == list(b.unit_bytes.items())
            and list(a.unit_input_bytes.items()) == list(b.unit_input_bytes.items()))


def derived_trace(two: Any, three: Any, four: Any, depth: int, container: str) -> Any:
    """The trace at ``depth`` blocks from the traces at two and three (see the module); None unless they give the
    trace at four, ``four``, exactly."""
    once = deepen(two, three, 4, container)
    if once is None or not _same(once, four):
        return None
    return deepen(two, three, depth, container)


def grow_runs(three: list[tuple[str, Any]], depth: int, container: str) -> list[tuple[str, Any]] | None:
    """Records of a three-block model in the order a step made them, ``(name, value)`` (a unit's or a parameter's
    name), at ``depth`` (>= 3) blocks: the records outside the blocks and block 0's kept, block 2's (the last) renamed
    ``<container>.<depth - 1>``, and block 1's (one between the first and the last) repeated as blocks 2 ... depth - 2
    between block 1's and the last's, on the side block 2's lie (after them in forward order, before them in
    backward's). None unless blocks 1's and 2's records are each one run, side by side."""
    prefix = f"{container}." if container else ""
    index = [(_block(name, prefix) or (None,))[0] for name, _ in three]
    if any(i is not None and i > 2 for i in index):
        return None
    runs = {}
    for b in (1, 2):
        where = [k for k, i in enumerate(index) if i == b]
        if not where or where != list(range(where[0], where[-1] + 1)):
            return None
        runs[b] = where

    def named(k: int, b: int) -> tuple[str, Any]:
        return f"{prefix}{b}{_block(three[k][0], prefix)[1]}", three[k][1]

    one, two = runs[1], runs[2]
    last = [named(k, depth - 1) for k in two]
    if two[0] == one[-1] + 1:
        return three[:two[0]] + [named(k, b) for b in range(2, depth - 1) for k in one] + last + three[two[-1] + 1:]
    if one[0] == two[-1] + 1:
        return three[:two[0]] + last + [named(k, b) for b in range(depth - 2, 1, -1) for k in one] + three[one[0]:]
    return None
