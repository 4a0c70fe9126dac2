"""The step's MemTracker (:class:`StepMemTracker`): MemTracker's optimizer-state region narrowed to the optimizer's
update, and the ``unsharded`` and ``comm`` storages named by the collectives they meet (``zeroexp._lib.memtrack``'s
docstring describes the categories). Imported by :func:`zeroexp._lib.memtrack.step_mem_tracker` when a tracker is
made, and by :func:`zeroexp._lib.memtrack.import_mem_tracker` (the ranks' forkserver preload): importing it imports
torch's private ``torch.distributed._tools.mem_tracker`` (torch 2.13)."""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from copy import deepcopy
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import (_TOTAL_KEY, MemTracker, _MemRefType, _RefType, _UpdateType,
                                                  _WeakRefInfo)
from torch.utils._pytree import tree_flatten

__all__ = ["NAME_REPEATED", "StepMemTracker"]


class _Role(_RefType):
    UNSHARDED = "Unsharded"
    COMM = "Comm"


#: Ops whose outputs are born with a role (the outputs are new storages).
_BORN = {"fsdp::all_gather_copy_in": _Role.UNSHARDED}
#: Ops whose arguments receive one (their ``out``).
_MARKS = {"fsdp::split_with_sizes_copy": _Role.UNSHARDED, "fsdp::chunk_cat": _Role.COMM}


def _named_args(func: Any, args: tuple, kwargs: dict | None) -> list[tuple[str, Any]]:
    """An op's arguments with their schema names (``output_tensor``, ``input_tensor``, ``tensors``, ``out``)."""
    names = [a.name for a in func._schema.arguments]
    return [*zip(names, args), *(kwargs or {}).items()]


def _is_all_gather(name: str) -> bool:
    return "allgather" in name or "all_gather" in name


def _argument_role(name: str, arg: str) -> Any:
    """The role argument ``arg`` of op ``name`` (a collective, or one of :data:`_MARKS`) receives, or None: an
    all-gather's output is a unit gathered; its input and every other collective's tensors: comm."""
    if name in _MARKS:
        return _MARKS[name] if arg == "out" else None
    return _Role.UNSHARDED if _is_all_gather(name) and arg.startswith("output") else _Role.COMM


def _born_role(ns: str, name: str) -> Any:
    """The role the outputs of op ``name`` (in namespace ``ns``) are born with, or None: :data:`_BORN`'s, or a
    functional collective's (an all-gather's ``unsharded``, any other's ``comm``)."""
    return _BORN.get(name) or (
        (_Role.UNSHARDED if _is_all_gather(name) else _Role.COMM)
        if ns == "_c10d_functional" else None)


class _Blocked(_WeakRefInfo):
    """A storage counted in ``block``-byte blocks (an attribute set with the class) whatever its device (MemTracker
    rounds CUDA storages only, to 512 B; the planner traces CPU fakes of a step it predicts for CUDA)."""

    block: int

    def _calculate_mem_consumed(self) -> int:
        from zeroexp.formulas.peak.allocator import counted

        return counted(self.size * self.element_size, self.block)


#: What torch's ModTracker (inside MemTracker) warns when a module enters a name already on its stack of parents.
NAME_REPEATED = "The module hierarchy tracking maybe be messed up"


@contextmanager
def _quiet_module_names() -> Iterator[None]:
    """Without ModTracker's :data:`NAME_REPEATED` warning and with ``warnings.formatwarning`` as it was (torch 2.13's
    ``mod_tracker.py`` replaces it for the process before it warns). A module outside the model's named hierarchy is
    named by its class: transformers' hub kernels wrap functions in such modules (Llama's ``apply_rotary_pos_emb``, a
    ``Func`` calling a ``Func``), so the inner one repeats its parent's name. The warning is about ModTracker's
    per-module statistics, which zeroexp never reads (a step's totals by category and phase, the storages' roles);
    printed, it asked a user of ``python -m zeroexp.plan`` to file a bug with PyTorch."""
    format_warning = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NAME_REPEATED)
        try:
            yield
        finally:
            warnings.formatwarning = format_warning


class StepMemTracker(MemTracker):
    """A MemTracker whose optimizer-state region is only the optimizer's update (see the memory probe), and which
    names the ``unsharded`` and ``comm`` storages (``zeroexp._lib.memtrack``'s docstring). ``block`` > 1: every
    storage is counted in blocks of that many bytes (CUDA's 512: ``zeroexp.formulas.peak.allocator.counted``)."""

    def __init__(self, block: int = 1) -> None:
        super().__init__()
        self._block = int(block)
        # The snapshots are also updated from gloo's worker threads: a storage a finished work object held last
        # is freed there, and MemTracker's weakref callback subtracts it. ``d[k] -= n`` is not atomic across
        # threads, nor is a snapshot's deepcopy: every update of the current snapshot and every copy of it holds
        # this lock (the phases' snapshots are copies only this thread touches).
        self._snap_lock = threading.RLock()
        self._ref_class = (*_MemRefType, *_Role)  # every snapshot has a key for each category
        self._clock = 0  # counts allocations once entered: a storage's birth, and the peak's moment
        self._peak_clock: dict[torch.device, int] = {}
        self._born_role: Any = None  # the role of the outputs of the op being dispatched (``_BORN``)
        self._settled = False  # see ``settle``
        #: each closed phase's peak snapshot and its moment (``close_phase``), corrected as storages get roles
        self.phases: dict[str, tuple[dict, dict]] = {}
        #: every storage born (or grown from 0 B) while entered, once, with the op that made it and the innermost module
        #: it was made in (``zx_op``, ``zx_module``) and its bytes from each moment on (``zx_sizes``: allocated,
        #: resized, ``resize_(0)`` as FSDP frees its unsharded buffers, freed): what was alive at a phase's peak
        #: (:meth:`born_alive_at`)
        self.births: list[Any] = []
        self._op = ""  # the op being dispatched

    # Lightning runs forward and backward inside ``optimizer.step(closure)``: MemTracker's global step
    # hooks would label every activation "optimizer state". The probe marks the update region instead.
    def _register_global_optimizer_hook(self) -> None:
        pass

    def set_in_optimizer_update(self, flag: bool) -> None:
        self._in_opt = flag

    def get_tracker_snapshot(self, type: str = "current") -> dict:  # noqa: A002 - MemTracker's name
        with self._snap_lock:
            return super().get_tracker_snapshot(type)

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now (MemTracker only ever raises its peak)."""
        with self._snap_lock:
            self._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in self._curr_mem_snap.items()}
            self._peak_mem_snap = deepcopy(self._curr_mem_snap)
            self._peak_clock = dict.fromkeys(self._peak_mem, self._clock)

    def __enter__(self) -> Any:
        self._quiet = _quiet_module_names()
        self._quiet.__enter__()
        super().__enter__()
        self._peak_clock = dict.fromkeys(self._peak_mem, self._clock)  # the first peak: the bytes at entry
        return self

    def __exit__(self, *args: Any) -> Any:
        try:
            return super().__exit__(*args)
        finally:
            self._quiet.__exit__(None, None, None)

    def close_phase(self, phase: str) -> None:
        """Keep the peak of the phase that ends now (:func:`~zeroexp._lib.memtrack.totals` of ``phases[phase][0]``
        reads it at the step's end, once every storage alive at it has its role), or the phase's earlier peak if that
        was as high (a phase recurs per micro-batch under accumulation); call ``reset_peak`` to start the next."""
        def total(snap: dict) -> int:
            return sum(dev[_TOTAL_KEY] for dev in snap.values())

        with self._snap_lock:
            if phase not in self.phases or total(self._peak_mem_snap) > total(self.phases[phase][0]):
                self.phases[phase] = (self._peak_mem_snap, self._peak_clock)

    # MemTracker's gradient hooks cannot be registered on a frozen parameter (requires_grad=False), nor on the
    # non-leaf parameter views FSDP1 with use_orig_params=True exposes in forward: MemTracker's two hooks (the
    # gradient as autograd computes it, and once accumulated) go on the trainable leaves alone, so a model mixing
    # frozen and trainable parameters (LoRA) still labels its gradients as backward makes them.
    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> Any:
        out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for p in module.parameters():
                if p.is_leaf and p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                    self._param_to_grad_hook_handles[p] = (p.register_hook(self._label_grad),
                                                           p.register_post_accumulate_grad_hook(
                                                               lambda q: self._label_grad(q.grad)))
        return out

    def _label_grad(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    # -- births: a storage allocated, or grown from zero bytes, after the tracker was entered; its labels since
    def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None,
                     old_reftype: Any = None) -> None:
        if self._block > 1 and u_type in (_UpdateType.ADD, _UpdateType.SIZE) \
                and not isinstance(winfo, _Blocked):  # counted in blocks from its first bytes on (0 B stays 0)
            winfo.__class__, winfo.block = _Blocked, self._block
            winfo.mem_consumed = winfo._calculate_mem_consumed()
        with self._snap_lock:
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            self._clock += 1
            grown = u_type == _UpdateType.SIZE and not old_mem_consumed and winfo.mem_consumed
            if self._depth and (u_type == _UpdateType.ADD or grown):
                winfo.zx_born, winfo.zx_labels = self._clock, [(self._clock, winfo.reftype)]
                if not hasattr(winfo, "zx_sizes"):  # a storage grown from 0 B again keeps its first record
                    winfo.zx_op, winfo.zx_module = self._op or "(no op: a hook or the optimizer)", self._innermost()
                    winfo.zx_sizes = []
                    self.births.append(winfo)
            elif u_type == _UpdateType.REF and hasattr(winfo, "zx_labels"):
                winfo.zx_labels.append((self._clock, winfo.reftype))
            if hasattr(winfo, "zx_sizes") and u_type != _UpdateType.REF:  # its bytes from each moment on
                winfo.zx_sizes.append((self._clock, 0 if u_type == _UpdateType.DEL else int(winfo.mem_consumed)))

    def _innermost(self) -> str:
        """The innermost module the dispatched op runs in (ModTracker's deepest entered name; backward marked), or
        ``(no module)`` outside every module (the optimizer's update, a hook)."""
        names = [n for n in getattr(self._mod_tracker, "parents", ()) if n != "Global"]
        if not names:
            return "(no module)"
        deepest = max(names, key=lambda n: (n.count("."), n))
        return deepest + (" (backward)" if getattr(self._mod_tracker, "is_bw", False) else "")

    def born_alive_at(self, phase: str) -> list[tuple[int, str, str, str]]:
        """The storages born while tracked and holding bytes at the moment of ``phase``'s peak (``close_phase``):
        ``(bytes then, category, op, module)`` each, the category as the step ended (``settle``'s names) or as it was
        labelled then."""
        if phase not in self.phases:
            return []
        clock = self.phases[phase][1]
        out = []
        for w in self.births:
            at = clock.get(w.device, -1)
            then = [b for moment, b in w.zx_sizes if moment <= at]  # its bytes at the peak (resize_(0) frees)
            if not then or not then[-1]:
                continue
            labels = [label for moment, label in w.zx_labels if moment <= at]
            role = getattr(w, "zx_role", None) or (labels[-1] if labels else w.reftype)
            out.append((then[-1], getattr(role, "value", str(role)), w.zx_op, w.zx_module))
        return out

    # After every op: the device's peak, as MemTracker keeps it, and its moment. Not MemTracker's per-module
    # peaks, which nothing in zeroexp reads: its walk over every tracked module on every op was 12 % of a small
    # FSDP cell's rank CPU (py-spy), more for models of many modules and in the planner's traces.
    def _update_peak_stats(self, peak_state: Any) -> None:
        with self._snap_lock:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = deepcopy(snap)
                    self._peak_clock[dev] = self._clock

    # -- roles: kept for the step (MemTracker re-labels a parameter's storage in each module's hooks), until
    # ``settle``: at the step's end a named storage that is then model state (a reduce-scatter's output kept as
    # the sharded gradient) is counted as that state, from its birth.
    def settle(self) -> None:
        self._settled = True

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype: Any, update_existing: bool = False) -> Any:
        roles = {id(w): (w, getattr(w, "zx_role", None)) for st in get_untyped_storages(t)
                 for w in (self._WINFO.get(st, (None, None))[0],) if w is not None}
        winfos = super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        for w, role in roles.values():
            if role is None or w.reftype == role:
                continue
            state, w.reftype = w.reftype, role  # undo MemTracker's re-label, then decide
            self._update_snap(_UpdateType.REF, w, old_reftype=state)
            if self._settled:
                self._name(w, state)
        return winfos

    def _assign(self, t: torch.Tensor, role: Any, resident: bool = False) -> None:
        """Name the storages of ``t`` ``role``, unless already named: those born in this step, and, with
        ``resident`` (a collective other than an all-gather), those alive since its start that no module or
        optimizer claims (``Other``: DDP's gradient buckets; not zeroexp's ZeRO master shard, an all-gather's
        input), from the start."""
        for st in get_untyped_storages(t):
            w = self._WINFO.get(st, (None, None))[0]
            if w is None or getattr(w, "zx_role", None) is not None:
                continue
            if resident and getattr(w, "zx_born", None) is None and w.reftype == _MemRefType.OTH:
                w.zx_born, w.zx_labels = 0, [(0, w.reftype)]
            if getattr(w, "zx_born", None) is not None:
                self._name(w, role)

    def _name(self, w: Any, role: Any) -> None:
        """Count ``w`` as ``role`` since its birth: in the current snapshot, and in each phase's peak snapshot it
        was alive at (moved from its label at that moment)."""
        w.zx_role = role
        for snap, clock in (*self.phases.values(), (self._peak_mem_snap, self._peak_clock)):
            at, peak = clock.get(w.device, -1), snap.get(w.device)
            if peak is None or w.zx_born > at:
                continue
            then = [label for moment, label in w.zx_labels if moment <= at][-1]
            if then != role:
                peak[then] -= w.mem_consumed
                peak[role] = peak.get(role, 0) + w.mem_consumed
        if w.reftype != role:
            old, w.reftype = w.reftype, role
            self._update_snap(_UpdateType.REF, w, old_reftype=old)

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        super()._track(self._born_role or reftype, t)
        if self._born_role is not None:
            self._assign(t, self._born_role)

    def _assign_arguments(self, func: Any, ns: str, name: str, args: tuple, kwargs: dict | None) -> None:
        """Name the tensors among the arguments of a collective (namespace ``ns``), or of one of :data:`_MARKS`, by
        :func:`_argument_role`."""
        for arg, value in _named_args(func, args, kwargs):
            role = _argument_role(name, arg)
            for t in tree_flatten(value)[0] if role is not None else ():
                if isinstance(t, torch.Tensor):
                    self._assign(t, role, resident=ns == "c10d" and not _is_all_gather(name))

    def _copies_unsharded(self, name: str, args: tuple) -> bool:
        """Whether op ``name`` clones a part of an ``unsharded`` storage: FSDP2's post-forward shard
        (``reshard_after_forward=k``: ``FSDPParam.to_sharded_post_forward`` keeps its 1/k of the gathered unit as
        ``all_gather_outputs[0].narrow(...).clone()``), unsharded too, held from the unit's forward to its backward."""
        if name != "aten::clone" or not args or not isinstance(args[0], torch.Tensor):
            return False
        return any(getattr(self._WINFO.get(st, (None, None))[0], "zx_role", None) == _Role.UNSHARDED
                   for st in get_untyped_storages(args[0]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        ns = getattr(func, "namespace", "")
        name = f"{ns}::{getattr(func, '_opname', '')}"
        if ns in ("c10d", "_c10d_functional") or name in _MARKS:
            self._assign_arguments(func, ns, name, args, kwargs)
        self._born_role = _Role.UNSHARDED if self._copies_unsharded(name, args) else _born_role(ns, name)
        self._op = name
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._born_role, self._op = None, ""
