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
device (``zeroexp.plan.shape.derived_units``, by :func:`grow_runs`), a step's counted FLOPs
(``zeroexp.plan.flops.step_flops``) and the training step the peak model reads (:func:`derived_step`, below).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

__all__ = ["stack_of", "at_depth", "deepen", "derived_trace", "grow_runs", "deepen_step", "derived_step",
           "DERIVED_ABOVE", "STEP_DEPTHS"]

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
    kept = _grow(two.unit_policy_bytes, three.unit_policy_bytes, depth, prefix)
    if units is None or inputs is None or kept is None or not any(_block(name, prefix) for name in two.unit_bytes):
        return None
    return replace(two, unit_bytes=units, unit_input_bytes=inputs, unit_policy_bytes=kept,
                   held_bytes=_affine(two.held_bytes, three.held_bytes, depth),
                   tensors=_affine(two.tensors, three.tensors, depth))


def _same(a: Any, b: Any) -> bool:
    """Equal traces, the order of their units included."""
    return (a == b and list(a.unit_bytes.items()) == list(b.unit_bytes.items())
            and list(a.unit_input_bytes.items()) == list(b.unit_input_bytes.items())
            and list(a.unit_policy_bytes.items()) == list(b.unit_policy_bytes.items()))


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


# -- The planner's traced step (``zeroexp.plan.steptrace.StepTrace``). Its segments are cumulative (the bytes live at
# each hook, by category, above the step's start), so a block's records depend on where it lies, and the blocks next
# to either end of the stack differ from those between (PyTorch's autocast under a LoRA GPT: the second block's forward
# starts beside a cast the third's does not). At L blocks, a record of one of the :data:`EDGE` blocks at either end,
# or outside the blocks, is its record in the step at :data:`STEP_DEPTHS`' second depth plus its growth from the first
# depth to the second per further block; a record of block i between them is the first such block's (index EDGE) at
# the second depth, plus (i - EDGE) times the next block's less its, plus its growth from the first depth to the
# second per further block. The units of a step traced with its units (their parameters' indices) grow alike. The
# step at the third depth checks every field.

#: Blocks at each end of a stack whose step records are their own; the steps derived from (first two) and checked at.
EDGE = 2
STEP_DEPTHS = (2 * EDGE + 1, 2 * EDGE + 2, 2 * EDGE + 3)


def _role(name: str, prefix: str, depth: int) -> tuple[str, str, int | None]:
    """(``head<i>`` | ``tail<j>`` | ``mid`` | ``out``, the name less its block, the block's index) of a unit: the i-th
    block from the start or the j-th from the end (i, j < EDGE), one between, none."""
    b = _block(name, prefix)
    if b is None:
        return "out", name, None
    i, rest = b
    pos = f"head{i}" if i < EDGE else f"tail{depth - 1 - i}" if i >= depth - EDGE else "mid"
    return pos, rest, i


def _pos(key: tuple) -> str:
    """A record key's role (:func:`_step_records`)."""
    return key[3] if key[0] == "segment" else key[1]


def _step_records(trace: Any, prefix: str, depth: int) -> tuple[list[tuple[tuple, int | None]], dict]:
    """The trace's segments and units as ``(role key, block)`` in their order (a block between the edges keeps its
    index; any other record, None), and each one's values by that pair (a list: a key recurs for a unit called more
    than once)."""
    keys, values = [], {}
    for s in trace.segments:
        pos, rest, i = _role(s.unit, prefix, depth)
        key = ("segment", s.phase, s.at, pos, rest)
        keys.append((key, i if pos == "mid" else None))
        values.setdefault(keys[-1], []).append(
            {"peak_bytes": s.peak_bytes, "end_bytes": s.end_bytes,
             **{("peak", c): v for c, v in s.peak_by_category.items()},
             **{("end", c): v for c, v in s.end_by_category.items()}})
    for u in trace.units:
        pos, rest, i = _role(u.name, prefix, depth)
        key = ("unit", pos, rest, len(u.params), u.grad_input, u.reached)
        keys.append((key, i if pos == "mid" else None))
        values.setdefault(keys[-1], []).append({("param", k): p for k, p in enumerate(u.params)})
    return keys, values


def _expand(deeper: list[tuple[tuple, int | None]], depth: int) -> list[tuple[tuple, int | None]] | None:
    """The order of the step at the second of :data:`STEP_DEPTHS` (two blocks between the edges) at ``depth``
    blocks: each run of those two blocks' records (side by side, in forward's or backward's order) becomes blocks
    EDGE ... depth - EDGE - 1's. None where the blocks between the edges are not such runs."""
    out, k = [], 0
    while k < len(deeper):
        if _pos(deeper[k][0]) != "mid":
            out.append(deeper[k])
            k += 1
            continue
        end = k
        while end < len(deeper) and _pos(deeper[end][0]) == "mid":
            end += 1
        run = deeper[k:end]
        half = len(run) // 2
        first, second = run[:half], run[half:]
        if len(run) % 2 or [key for key, _ in first] != [key for key, _ in second] or \
                {i for _, i in first} | {i for _, i in second} != {EDGE, EDGE + 1} or len({i for _, i in first}) != 1:
            return None
        blocks = range(EDGE, depth - EDGE) if first[0][1] == EDGE else range(depth - EDGE - 1, EDGE - 1, -1)
        out += [(key, b) for b in blocks for key, _ in first]
        k = end
    return out


def deepen_step(shallow: Any, deeper: Any, depth: int, container: str) -> Any:
    """The ``StepTrace`` at ``depth`` (>= the second of :data:`STEP_DEPTHS`) blocks of ``container`` from the steps
    traced at the first two of :data:`STEP_DEPTHS` (see above); None where their records do not line up or a derived
    byte count is negative."""
    from zeroexp.formulas.peak.phases import Segment, TracedUnit

    prefix = f"{container}." if container else ""
    d1, d2 = STEP_DEPTHS[:2]
    k1, v1 = _step_records(shallow, prefix, d1)
    k2, v2 = _step_records(deeper, prefix, d2)
    order = _expand(k2, depth)
    if order is None or shallow.loss_bytes != deeper.loss_bytes or shallow.batch_size != deeper.batch_size:
        return None
    seen: dict = {}
    segments, units = [], []
    for key, i in order:
        mid = i is not None
        n = seen[(key, i)] = seen.get((key, i), -1) + 1
        try:
            a1, a2 = v1[(key, EDGE if mid else None)][n], v2[(key, EDGE if mid else None)][n]
            b2 = v2[(key, EDGE + 1)][n] if mid else a2
        except (KeyError, IndexError):
            return None
        if not (set(a1) == set(a2) == set(b2)):
            return None
        v = {f: a2[f] + (depth - d2) * (a2[f] - a1[f]) + ((i - EDGE) * (b2[f] - a2[f]) if mid else 0) for f in a2}
        side, j = _pos(key)[:4], _pos(key)[4:]  # head<j>, tail<j>: the j-th block from the start, from the end
        block = i if mid else int(j) if side == "head" else depth - 1 - int(j) if side == "tail" else None
        rest = key[4] if key[0] == "segment" else key[2]
        name = rest if block is None else f"{prefix}{block}{rest}"
        if key[0] == "unit":
            units.append(TracedUnit(name, tuple(v[("param", k)] for k in range(key[3])), key[4], key[5]))
            continue
        if any(x < 0 for x in v.values()):
            return None
        peak, end = ({f[1]: x for f, x in v.items() if isinstance(f, tuple) and f[0] == kind}
                     for kind in ("peak", "end"))
        segments.append(Segment(key[1], name, key[2], v["peak_bytes"], peak, v["end_bytes"], end))
    out = replace(deeper, segments=tuple(segments), units=tuple(units))
    if shallow.recomputes or deeper.recomputes:  # grown as the segments are
        bare = {"units": (), "recomputes": ()}
        grown = deepen_step(replace(shallow, segments=shallow.recomputes, **bare),
                            replace(deeper, segments=deeper.recomputes, **bare), depth, container)
        return None if grown is None else replace(out, recomputes=grown.segments)
    return out


def derived_step(shallow: Any, deeper: Any, check: Any, depth: int, container: str) -> Any:
    """The ``StepTrace`` at ``depth`` blocks from the steps at the first two of :data:`STEP_DEPTHS`
    (:func:`deepen_step`); None unless they give the step at the third, ``check``, exactly (every segment, category
    and unit, in order)."""
    once = deepen_step(shallow, deeper, STEP_DEPTHS[2], container)
    if once is None or once != check:
        return None
    return deepen_step(shallow, deeper, depth, container)
