"""The peak model: what a rank holds above its steady state in each phase of a training step, by category."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, NamedTuple

from zeroexp.formulas.peak.adamw import adamw_temporary_blocks, update_phase

__all__ = ["Segment", "StepTrace", "TracedUnit", "FsdpUnit", "PHASES",
           "phase_peaks", "fsdp_phase_peaks", "fsdp_sync_phase_peaks", "highest_phases"]


@dataclass(frozen=True)
class Segment:
    """One stretch of the traced step, ending at a hook: ``phase`` (forward | backward), the ``unit`` whose hook ends
    it (``loss``: the loss and its copy; ``root``: the end of backward), ``at`` (start | end of that unit); the peak
    inside the stretch and the bytes live at its end, relative to the step's start, by category."""

    phase: str
    unit: str
    at: str
    peak_bytes: int
    peak_by_category: dict
    end_bytes: int
    end_by_category: dict


class TracedUnit(NamedTuple):
    """A traced unit as its forward ran: ``name``; ``params``: its own parameters (indices in the model's
    ``parameters()`` order; a shared one under every module that uses it); ``grad_input``: whether any input of its
    forward required grad (if none did, autograd never runs back through its input); ``reached``: whether its output
    required grad (if not, backward never reaches the unit: frozen, fed by nothing that trains)."""

    name: str
    params: tuple[int, ...]
    grad_input: bool
    reached: bool = True


@dataclass(frozen=True)
class StepTrace:
    """The bare model's step (``zeroexp.plan.steptrace.trace_step``): segments in time order; ``loss_bytes``: the
    previous step's loss scalars the training loop keeps at the step boundary, freed in the next forward (Lightning's
    ``ClosureResult`` copy of the loss; under ``logger=csv`` also the loss itself, which ``self.log`` holds:
    :meth:`for_cell`); ``seed_bytes``: one loss's storage (autograd's seed of backward); ``units``: the units in the
    order of their first forward (recorded when traced with ``own_params_units``)."""

    batch_size: int
    segments: tuple[Segment, ...]
    loss_bytes: int
    units: tuple[TracedUnit, ...] = ()
    #: Traced with ``own_params_units`` and checkpointing: each hook of a unit's forward run again inside backward
    #: (phase ``recompute``: the stretch since the last mark or recompute mark, ending at it), then the rest of the
    #: backward segment they fall in (phase ``tail``, named as that segment), in time order; the segments themselves
    #: span their recompute.
    recomputes: tuple[Segment, ...] = ()
    seed_bytes: int = 0

    def backward_start(self) -> dict[str, int]:
        """Backward's start above steady: the forward's end less steady's loss scalars, plus autograd's seed."""
        end = next(s for s in self.segments if (s.phase, s.unit) == ("forward", "loss"))
        return _add(end.end_by_category, {"activations": -self.loss_bytes, "temporaries": self.seed_bytes})

    def for_cell(self, logs_loss: bool) -> "StepTrace":
        """This step as a cell runs it: where the cell hands its loss to ``self.log`` (``Cell.logs_loss``), Lightning's
        logger keeps the previous step's loss (``loss.detach()``, its storage) to the next step's forward beside the
        closure's copy: one loss more freed there (measured: steady's activations 8 B under ``logger=csv``, 4 B
        otherwise, a forward 4 B lower above it)."""
        return dataclasses.replace(self, loss_bytes=self.loss_bytes + self.seed_bytes) if logs_loss else self


#: The phases of a training step as the memory probe cuts it (zeroexp/probes/memory.py), in order.
PHASES = ("forward", "backward", "optimizer")


def _add(into: dict, cats: dict, sign: int = 1) -> dict:
    out = dict(into)
    for c, b in cats.items():
        out[c] = out.get(c, 0) + sign * int(b)
    return out


def _opened_by(buckets: tuple[int, ...], edges: list[int]) -> Callable[[int], int]:
    """The bytes of the buckets opened below a traced gradient figure: ``sum(b for b, lo in zip(buckets, edges) if lo
    < at)``, by bisection over the edges' running sums where they rise (a deep model's every backward segment asks
    it of every bucket), else by that sum."""
    edges = edges[:len(buckets)]
    if any(b < a for a, b in zip(edges, edges[1:])):
        return lambda at: sum(b for b, lo in zip(buckets, edges) if lo < at)
    below = list(itertools.accumulate(buckets[:len(edges)], initial=0))
    return lambda at: below[bisect.bisect_left(edges, at)]


def phase_peaks(trace: StepTrace, *, steady_grad_bytes: int, buckets: tuple[int, ...],
                optimizer_numels: tuple[int, ...], optimizer_itemsize: int, foreach: bool,
                in_place: StepTrace | None = None, master_grads: int = 0, gather_inputs: int = 0,
                reduce_copies: bool = False, block: int = 1, bucket_edges: tuple[int, ...] | None = None,
                live_grads: bool = False, open_buckets: bool = False) -> dict[str, dict]:
    """Per phase, the bytes a rank holds above its steady state at the phase's peak, by category; the family's
    gradient flow ``new`` (no flag), ``in_place`` (``live_grads``), ``bucket`` (and ``open_buckets``).

    Forward: the traced forward's peak (the previous step's loss and its copy freed first, ``trace.loss_bytes``).
    Backward: per traced segment, its peak, less what the flow does not allocate anew (``in_place`` and ``bucket``:
    the traced ``.grad`` tensors; ``new``: the steady gradients ``zero_grad`` freed), plus, for ``bucket``, every
    bucket opened before the segment started (``buckets``: each one's bytes in reduce order, opened by its first
    ready gradient). Optimizer: AdamW's temporaries over the tensors this rank steps
    (:func:`zeroexp.formulas.peak.adamw.adamw_temporary_blocks`, in ``block``-byte blocks), or, for ``bucket``,
    the buckets alive when the step begins if they are more (released before the update). Each
    segment's figure is a lower bound of the real one; the phase's peak is the largest. ``in_place``: the same step
    traced with the gradients allocated before it (``trace_step(grads_in_place=True)``), whose backward segments the
    ``in_place`` and ``bucket`` flows take instead of ``trace``'s less its gradients (they differ where activation
    checkpointing recomputes; ``trace`` still says when each bucket opens). Below fp32
    (:mod:`zeroexp.formulas.peak.precision`): ``master_grads``, the fp32 up-casts alive through the update;
    ``gather_inputs``, steady's all-gather inputs, freed in forward before its peak (every phase's figure less them).
    ``reduce_copies`` (``in_place`` and ``bucket``; gloo's reduce_scatter): waiting for a bucket's reduce-scatter in the
    step hands back gloo's reduced copy of the whole bucket (its ``split`` and ``copy_`` into the shard run on the
    waiting thread, in the update region: optimizer state), alive beside the buckets not yet released; the step waits
    for the buckets in definition order (the reverse of ``buckets``). ``bucket_edges``: the traced gradient bytes at
    which each bucket opens, where they are not the sums of the buckets before it (the trace counting each
    parameter's gradient in ``block``-byte blocks, a bucket one block run)."""
    if open_buckets and not live_grads:  # a bucket's gradients live in it across the step
        raise ValueError("open_buckets needs live_grads")
    forward = [s for s in trace.segments if s.phase == "forward"]
    top = max(forward, key=lambda s: s.peak_bytes)
    out = {"forward": {"bytes": top.peak_bytes - trace.loss_bytes,
                       "by_category": _add(top.peak_by_category, {"activations": -trace.loss_bytes})}}
    best, upper, before = None, None, 0  # before: traced gradient bytes at the segment's start
    edges = list(bucket_edges) if bucket_edges is not None else list(itertools.accumulate(buckets, initial=0))
    opened = _opened_by(buckets, edges)
    alike = in_place is not None and live_grads
    if alike and [(s.phase, s.at) for s in in_place.segments] != [(s.phase, s.at) for s in trace.segments]:
        raise ValueError("the in-place trace's segments are not the trace's")
    for k, s in enumerate(trace.segments):
        if s.phase != "backward":
            continue
        peak = in_place.segments[k].peak_by_category if alike else s.peak_by_category
        grads = peak.get("gradients", 0)
        cats = _add(peak, {"activations": -trace.loss_bytes})
        late = {}
        if not live_grads:
            cats = _add(cats, {"gradients": -steady_grad_bytes})
        else:
            cats = _add(cats, {"gradients": -grads})
            if open_buckets:
                held = opened(before)
                cats = _add(cats, {"comm": held})  # a bucket is its reduce-scatter's buffer from its birth
                # a bucket this segment opens may be born before its peak or after: the upper end of the range
                now = s.end_by_category.get("gradients", 0)
                late = {"comm": opened(now) - held if now > before else 0}
        total = sum(cats.values())
        if best is None or total > best["bytes"]:
            best = {"bytes": total, "by_category": cats}
        if upper is None or total + sum(late.values()) > upper["bytes"]:
            upper = {"bytes": total + sum(late.values()), "by_category": _add(cats, late)}
        before = s.end_by_category.get("gradients", 0)
    out["backward"] = best
    if upper is not None and best is not None and upper["bytes"] > best["bytes"]:
        out["backward"] = {**best, "upper_bytes": upper["bytes"], "upper_by_category": upper["by_category"],
                           "upper_note": "a bucket opened within a traced segment, born before its peak (the trace "
                                         "sees the segment's peak, not where in it the bucket's first gradient came)"}
    # What the update region allocates is labelled optimizer state by the memory probe: the up-casts too.
    temps = adamw_temporary_blocks(optimizer_numels, optimizer_itemsize, foreach, block)
    candidates = [update_phase(temps, master_grads, one_by_one=not gather_inputs)]
    waits = buckets[::-1]  # the step's order
    for j, size in enumerate(waits):  # at bucket j's wait: the buckets not released yet (bucket), gloo's copy of j
        held = sum(waits[j:]) if open_buckets else 0
        copy = size if reduce_copies and live_grads else 0
        candidates.append({"bytes": held + copy, "by_category": {"comm": held, "optimizer_state": copy}})
    out["optimizer"] = max(candidates, key=lambda rec: rec["bytes"])  # ties: AdamW's
    for rec in out.values():
        rec["bytes"] -= gather_inputs  # labelled optimizer state: the update region allocated them
        cats = _add(rec["by_category"], {"optimizer_state": -gather_inputs})
        rec["by_category"] = {c: int(b) for c, b in cats.items() if b}
        if "upper_bytes" in rec:
            rec["upper_bytes"] -= gather_inputs
            up = _add(rec["upper_by_category"], {"optimizer_state": -gather_inputs})
            rec["upper_by_category"] = {c: int(b) for c, b in up.items() if b}
    return out


class _Highest:
    """The highest of each phase's candidate moments, by category (zeros left out): the lower bound, and the upper
    end of its range where a moment holds tensors only gloo's timing may keep (``timing``)."""

    def __init__(self) -> None:
        self.best: dict[str, dict] = {}
        self.upper: dict[str, dict] = {}

    @staticmethod
    def _higher(into: dict[str, dict], phase: str, cats: dict) -> None:
        cats = {c: int(b) for c, b in cats.items() if b}
        if phase not in into or into[phase]["bytes"] < sum(cats.values()):
            into[phase] = {"bytes": sum(cats.values()), "by_category": cats}

    def keep(self, phase: str, cats: dict, timing: dict | None = None, note: str = "") -> None:
        """A candidate moment; ``timing``: what it holds beyond ``cats`` only when gloo's worker still holds it then
        (the upper end of the range, named by ``note``)."""
        self._higher(self.best, phase, cats)
        self._higher(self.upper, phase, _add(cats, timing or {}))
        if timing and any(timing.values()) and self.upper[phase]["bytes"] == sum(_add(cats, timing).values()):
            self.upper[phase]["note"] = note

    def phases(self, optimizer_temporaries: tuple[int, ...]) -> dict[str, dict]:
        """Forward and backward as kept (with ``upper_bytes``, ``upper_by_category`` and ``upper_note`` where the
        range's upper end is higher); the optimizer phase: AdamW's temporaries (:func:`adamw_temporary_blocks`; more
        than one: its ``blocks``, :func:`allocations`)."""
        out = {}
        for ph, rec in self.best.items():
            out[ph] = dict(rec)
            up = self.upper.get(ph)
            if up is not None and up["bytes"] > rec["bytes"]:
                out[ph].update(upper_bytes=up["bytes"], upper_by_category=up["by_category"],
                               upper_note=up.get("note", ""))
        return {**out, "optimizer": update_phase(optimizer_temporaries)}


def _unit_index(trace: StepTrace, units: list) -> dict[str, int]:
    """Each traced unit's position in forward order (the k-th traced unit is the k-th FSDP unit)."""
    k_of = {s.unit: i for i, s in enumerate(s for s in trace.segments if s.phase == "forward" and s.at == "end"
                                            and s.unit != "loss")}
    if len(k_of) != len(units):
        raise ValueError(f"{len(k_of)} traced units, {len(units)} FSDP units")
    return k_of


class FsdpUnit(NamedTuple):
    """One FSDP1 unit for the peak model: ``unsharded`` (its padded FlatParameter, bytes), ``shard`` (one rank's
    share of it), ``grads`` (its parameters' own gradients, unpadded, as autograd computes them). Below fp32
    (:mod:`zeroexp.formulas.peak.precision`): ``upcast``, the fp32 copy of the reduced shard, allocated beside it
    after the reduce-scatter returned (gloo's copy of its input freed) and kept instead of it; ``gather_copy``, FSDP1's
    compute-dtype copy of the shard (``_mp_shard``) alive while the unit is all-gathered. 0: fp32. ``reduced``: the
    bytes of its reduce-scatter's input where they are not ``unsharded`` (FSDP2 with frozen parameters: the padded
    trainable ones; 0: no reduce-scatter), ``shard`` then that input's share. ``last_grad``: the gradient of its last
    trainable parameter (definition order), which FSDP2's reduction keeps referenced while it reduces. ``params``:
    FSDP2, each parameter's padded unsharded bytes in the unit's order (``reshard_after_forward=k`` reshards them one
    by one: :func:`post_forward_bump`)."""

    unsharded: int
    shard: int
    grads: int
    upcast: int = 0
    gather_copy: int = 0
    reduced: int | None = None
    last_grad: int = 0
    params: tuple[int, ...] = ()

    @property
    def scattered(self) -> int:
        """The bytes of its reduce-scatter's input (0: none)."""
        return self.unsharded if self.reduced is None else self.reduced


# [Note: FSDP1's phase peaks]
# Forward: while unit k computes, FULL_SHARD holds k unsharded, SHARD_GRAD_OP every unit up to k (freed after backward).
# Backward, unit u after the units before it in backward order: two moments, read from FSDP1's post-backward hook
# (torch/distributed/fsdp/_runtime_utils.py): A -- the per-parameter gradients (``grads``) are concatenated into the
# FlatParameter's unsharded gradient (a new ``unsharded`` buffer) while u is still unsharded; B -- u is resharded, the
# reduce-scatter's output (``shard``) is allocated, and on gloo ``_reduce_scatter_base`` copies its input (another
# ``unsharded``). Both hold the bare backward's activations and their gradients at u's end (the trace, its parameter
# gradients taken out), the sharded gradients of the units done (``zero_grad`` freed the steady ones), and the unsharded
# units: FULL_SHARD u at A; BACKWARD_PRE the next unit at A and B, BACKWARD_POST at B only; SHARD_GRAD_OP every unit not
# yet done (u at A only). Optimizer: AdamW's temporaries over the shards. Categories as the memory probe names them
# (zeroexp/_lib/memtrack.py): the units gathered are ``unsharded``, the unsharded gradient (the reduce-scatter's input)
# ``comm``, the output shards ``gradients`` (FSDP keeps them as the sharded gradient). ``grads_held_into_backward``
# (zeroexp.formulas.orig_params): backward starts holding the steady shards.
def fsdp_phase_peaks(trace: StepTrace, units: list[FsdpUnit], *, root: int, steady_grad_bytes: int,
                     reshard_after_forward: bool, prefetch: str, gloo: bool,
                     optimizer_numels: tuple[int, ...], optimizer_itemsize: int, foreach: bool,
                     block: int = 1, grads_held_into_backward: bool = False,
                     shards_held: bool = False) -> dict[str, dict]:
    """FSDP1 (FlatParameter per unit; ``units`` in forward order, ``root``: the root unit's unsharded bytes, held from
    its forward to the end of backward), per phase, the bytes above steady at the peak, by category. ([Note: FSDP1's
    phase peaks] above.) ``shards_held``: a later micro-batch reducing every micro-batch
    (:func:`fsdp_sync_phase_peaks`)."""
    k_of = _unit_index(trace, units)
    best = _Highest()
    _fsdp_forward(best.keep, trace, units, k_of, root=root, reshard_after_forward=reshard_after_forward,
                  grads_held_into_backward=grads_held_into_backward)
    _fsdp_backward(best.keep, trace, units, k_of, root=root, steady_grad_bytes=steady_grad_bytes,
                   reshard_after_forward=reshard_after_forward, prefetch=prefetch, gloo=gloo, shards_held=shards_held)
    return best.phases(adamw_temporary_blocks(optimizer_numels, optimizer_itemsize, foreach, block))


def fsdp_sync_phase_peaks(trace: StepTrace, units: list[FsdpUnit], **kwargs) -> dict[str, dict]:
    """FSDP1 reducing every micro-batch of a step (``grad_accum=K`` with ``strategy.sync_each_microbatch``: no
    ``no_sync``), per phase the highest over the micro-batches of :func:`fsdp_phase_peaks` (``kwargs``: its keywords).

    The first micro-batch starts as a step without accumulation; every later one holds every unit's sharded gradient
    from its start (no ``zero_grad`` inside an accumulation: Lightning's closure) and each unit's reduce-scatter output
    is a transient: torch/distributed/fsdp/_flat_param.py ``prepare_gradient_for_backward`` keeps the shard as
    ``_saved_grad_shard``, _runtime_utils.py ``_accumulate_sharded_grad`` adds the new one into it
    (``flat_param._saved_grad_shard += sharded_grad``), which is then dropped."""
    return highest_phases(fsdp_phase_peaks(trace, units, **kwargs),
                          fsdp_phase_peaks(trace, units, **kwargs, shards_held=True))


def highest_phases(*runs: dict[str, dict]) -> dict[str, dict]:
    """Per phase of the first run, the highest of the runs' records (the micro-batches of one optimizer step: the
    memory probe keeps each phase's peak over them)."""
    return {ph: max((r[ph] for r in runs if ph in r), key=lambda rec: rec["bytes"]) for ph in runs[0]}


def _backward_order(k_of: dict[str, int]) -> list[tuple[str, int]]:
    """The traced units in backward order (the last unit first): each one's name and forward position."""
    return sorted(k_of.items(), key=lambda kv: -kv[1])


def _backward_ends(segs: list[Segment]) -> dict[str, int]:
    """Each unit's position in ``segs`` of the (first) segment ending its backward, by the unit's name."""
    ends: dict[str, int] = {}
    for j, s in enumerate(segs):
        if s.phase == "backward" and s.at == "end":
            ends.setdefault(s.unit, j)
    return ends


def _fsdp_forward(keep: Callable[..., None], trace: StepTrace, units: list[FsdpUnit], k_of: dict[str, int], *,
                  root: int, reshard_after_forward: bool, grads_held_into_backward: bool = False) -> None:
    """:func:`fsdp_phase_peaks`' forward moments, each to ``keep``: unit k computing, and before its pre-hook and
    gathered at its end; the loss (and with ``grads_held_into_backward``, backward's start, the units held alike)."""
    full = [u.unsharded for u in units]
    for s in (s for s in trace.segments if s.phase == "forward"):
        act = {"activations": -trace.loss_bytes}
        if s.unit == "loss":
            held = root + (0 if reshard_after_forward else sum(full))
            keep("forward", _add(_add(s.peak_by_category, act), {"unsharded": held}))
            if grads_held_into_backward:
                keep("backward", _add(trace.backward_start(), {"unsharded": held}))
            continue
        k = k_of[s.unit]
        done = sum(full[:k]) if not reshard_after_forward else 0
        if s.at == "end":  # unit k computing
            keep("forward", _add(_add(s.peak_by_category, act), {"unsharded": root + done + full[k]}))
        else:  # before unit k's pre-hook: k gathered at its end (from its shard's compute-dtype copy, below fp32)
            keep("forward", _add(_add(s.peak_by_category, act), {"unsharded": root + done}))
            copy = units[k].gather_copy  # the all-gather's input: comm
            keep("forward", _add(_add(s.end_by_category, act),
                                 {"unsharded": root + done + full[k], **({"comm": copy} if copy else {})}))


def _fsdp_backward(keep: Callable[..., None], trace: StepTrace, units: list[FsdpUnit], k_of: dict[str, int], *,
                   root: int, steady_grad_bytes: int, reshard_after_forward: bool, prefetch: str, gloo: bool,
                   shards_held: bool = False) -> None:
    """:func:`fsdp_phase_peaks`' backward moments, each to ``keep``: per unit in backward order, the trace's own peaks
    (u computing; for the first unit, the loss's backward before it) and, where it reduces, moments A and B
    (``shards_held``: every sharded gradient held throughout, steady's, each reduction's output a transient the
    memory probe leaves ``comm``)."""
    full = [u.unsharded for u in units]
    if shards_held:  # nothing freed before backward; no reduction's output kept
        steady_grad_bytes = 0
    segs = list(trace.segments)
    order = _backward_order(k_of)
    shards_done, grads_done = 0, 0  # the units done: their shards (kept), their traced full gradients (not kept)
    ends = _backward_ends(segs)
    for pos, (name, k) in enumerate(order):
        i = ends[name]
        u = units[k]
        after = segs[i + 1].end_by_category  # u's backward done, its output gradient freed
        t_act = after.get("activations", 0) - trace.loss_bytes
        t_temp = after.get("temporaries", 0)
        # The root unit's gradients (a tied head, the final norm) stay unsharded until the root's own post-backward
        # at the end: what the trace holds beyond the units' own.
        t_root = max(after.get("gradients", 0) - grads_done - u.grads, 0)
        nxt = full[order[pos + 1][1]] if pos + 1 < len(order) else 0
        pending = sum(full[j] for _, j in order[pos + 1:])
        if reshard_after_forward:
            held_a = u.unsharded + (nxt if prefetch == "pre" else 0)
            held_b = nxt if prefetch in ("pre", "post") else 0
        else:
            held_a, held_b = u.unsharded + pending, pending
        # The trace's own peaks: u computing, and, for the first unit, the loss's backward before it (nothing of
        # FSDP's happens there); their parameter gradients replaced by the shards done, the root's kept.
        # Before u's pre-backward hook FULL_SHARD holds nothing of u's, unless the root unit's own pre-backward hook
        # (the root has parameters: a head, a final norm) prefetched u under BACKWARD_PRE.
        held_before = held_a if not reshard_after_forward else (
            u.unsharded if prefetch == "pre" and root else 0)
        for seg, held in ((segs[i], held_a), *(((segs[i - 1], held_before),) if pos == 0 else ())):
            g = seg.peak_by_category.get("gradients", 0)
            keep("backward", _add(seg.peak_by_category, {
                "activations": -trace.loss_bytes, "unsharded": root + held,
                "gradients": shards_done - steady_grad_bytes - min(g, grads_done)}))
        # The unsharded gradient is the reduce-scatter's input (comm); its output shard is kept as the gradient.
        # Below fp32 the output shard is up-cast to fp32 (``u.upcast``), in a moment of its own beside gloo's copy of
        # the input: the larger of the two.
        # A unit whose FlatParameter is frozen has no post-backward reduction: neither moment.
        if u.scattered:
            keep("backward", {"activations": t_act, "temporaries": t_temp + u.grads, "comm": u.scattered,
                              "unsharded": root + held_a, "gradients": t_root + shards_done - steady_grad_bytes})
            # The parameters' own gradients are freed once concatenated; when backward ends at this unit (the model
            # is one unit) they may still be alive beside gloo's copy: the upper end of the range.
            last = pos + 1 == len(order) and not root
            keep("backward", {"activations": t_act,
                              "temporaries": t_temp + max(u.upcast, u.scattered if gloo else 0),
                              "comm": u.scattered + (u.shard if shards_held else 0), "unsharded": root + held_b,
                              "gradients": t_root + shards_done + (0 if shards_held else u.shard)
                              - steady_grad_bytes},
                 timing={"temporaries": u.grads if last and len(order) == 1 else 0},
                 note=f"unit {k}'s own parameter gradients ({u.grads} B) still alive beside gloo's copy of its "
                      "reduce-scatter input, the model being one unit")
        shards_done += 0 if shards_held else u.upcast or u.shard
        grads_done += u.grads
