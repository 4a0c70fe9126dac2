"""DeepSpeed checkpoints (zeroexp.probes.checkpoint) for zeroexp.strategies.deepspeed.

At every stage; what DeepSpeed 0.19 writes differs by stage:
- **sharded**: DeepSpeed's own ``engine.save_checkpoint(path, tag="zeroexp")``, restored by ``engine.load_checkpoint``
  into the fresh engine (same world size). Stage 3: every rank writes its model states and its fp32 master and Adam
  partitions (``zero_pp_rank_<r>_mp_rank_00_{model,optim}_states.pt``). Stages 1, 2: rank 0 writes the module
  (``mp_rank_00_model_states.pt``, the compute-dtype weights), every rank its fp32 master and Adam partition
  (``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``). Stages 1-3: rank 0 also DeepSpeed's ``zero_to_fp32.py`` and
  ``zero_to_torch.py``. Stage 0 partitions nothing: rank 0 alone writes ``mp_rank_00_model_states.pt``, the module
  and the optimizer's ``state_dict`` in one file (no ``zero_pp_rank`` file; the other ranks write nothing).
- **full**: the consolidated fp32 state, on rank 0, in one file (:data:`DS_FULL_FILE`): every parameter's fp32
  master, its Adam moments and Adam's step count, by parameter name, in torch's state-dict layout (as
  ``get_state_dict(full_state_dict)`` writes it for DDP and FSDP: any of them starts from it, and DeepSpeed from
  theirs, ``checkpoint.load_from``; :func:`full_state`). Stages 1-3 read them with
  ``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (what ``zero_to_fp32`` would
  rebuild from a sharded checkpoint, without writing one first): stage 3 all-gathers each parameter's partitions,
  stages 1 and 2 all-reduce a zero buffer into which every rank copied its fragment (``_hp_mapping``), three
  collectives per parameter either way. Stage 0 has no ``_hp_mapping`` (the ``safe_get`` functions return None):
  everything is replicated, rank 0 reads the tensor the torch optimizer steps (the parameter in fp32; with bf16 the
  ``FP16_UnfusedOptimizer``'s fp32 copy in ``fp32_groups``) and its ``optimizer.state`` directly, no collective.
  Restore: every rank reads the file and sets the compute parameters from the fp32 master cast to the compute dtype
  (stage 3 inside ``GatheredParameters`` with ``modifier_rank=0``; stages 0-2 hold them replicated, every rank its
  copy), creates the torch optimizer's state (a fresh one has none before its first step) with the saved step (the
  latest of the file's parameters: DeepSpeed steps its flat partitions together), and
  sets the master and moments: ``safe_set_full_*`` (stages 1, 2 first link each parameter's fragment to the new
  moment tensors, ``_lazy_init_hp_params_optimizer_state``, which DeepSpeed otherwise does after the first step), at
  stage 0 the tensors themselves. Because the moments and the step are in the file, a full restore continues
  bit-identically (tested at N=2 in fp32 at every stage, both kinds); the fp32 weights alone
  (``zero_to_fp32``'s output) would not (fresh Adam moments), and the checkpoint probe's continuation check would
  report the difference. Not restored: DeepSpeed's engine counters (``global_steps``, ``global_samples``), an fp16
  loss scaler and an LR scheduler (zeroexp has none; fp16 needs a GPU): a full checkpoint is weights plus optimizer
  state, no more.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroexp._lib.deepspeed_internals import link_optimizer_state, linked_to_fp32_partition
from zeroexp.strategies._checkpoint import (FULL_FILE, latest_step, optim_by_name, read_full, whole_model_state,
                                            write_full)

__all__ = ["DS_FULL_FILE", "DS_TAG", "checkpoint_format", "save", "load", "full_state"]

#: The one file of a full DeepSpeed checkpoint (rank 0): fp32 master, Adam moments and step, by parameter name, in
#: torch's state-dict layout (zeroexp.strategies._checkpoint's full file: any strategy of that layout loads it).
DS_FULL_FILE = FULL_FILE
#: DeepSpeed's checkpoint tag (its subdirectory) for a sharded checkpoint.
DS_TAG = "zeroexp"


def checkpoint_format(stage: int, kind: str) -> str:
    """One sentence: how DeepSpeed at ZeRO ``stage`` writes a ``kind`` checkpoint."""
    if kind == "full":
        how = {0: "read on rank 0 from its replicated copy (the parameters, or with bf16 the FP16 optimizer's fp32 "
                  "copies, and the torch optimizer's state; no collective)",
               3: "all-gathered (deepspeed.utils.safe_get_full_fp32_param / safe_get_full_optimizer_state)"}
        gathered = how.get(stage, "all_reduce of each rank's fragments (deepspeed.utils."
                                       "safe_get_full_fp32_param / safe_get_full_optimizer_state)")
        return (f"consolidated fp32 state on rank 0 ({DS_FULL_FILE}): each parameter's fp32 master and Adam "
                f"moments {gathered} and Adam's step; no engine counters, loss scaler or scheduler")
    if stage == 0:
        return (f"DeepSpeed engine.save_checkpoint (tag {DS_TAG!r}), ZeRO stage 0: nothing is partitioned, rank 0 "
                "alone writes mp_rank_00_model_states.pt (the module and the optimizer's state_dict)")
    files = ("each rank its model states and its fp32 master and optimizer partitions (zero_pp_rank_<r>_*)"
             if stage == 3 else "rank 0 the module (mp_rank_00_model_states.pt), each rank its fp32 master "
                                     "and optimizer partitions (zero_pp_rank_<r>_mp_rank_00_optim_states.pt)")
    return (f"DeepSpeed engine.save_checkpoint (tag {DS_TAG!r}), ZeRO stage {stage}: {files}; rank 0 also "
            "zero_to_fp32.py and zero_to_torch.py")


def save(stage: int, kind: str, path: Path, model: Any) -> list[Path]:
    """Write the engine ``model``'s state as a ``kind`` checkpoint into ``path``; the files this rank wrote. A
    collective."""
    rank = dist.get_rank()
    if kind == "sharded":
        model.save_checkpoint(str(path), tag=DS_TAG, save_latest=False)
        dist.barrier()
        mine = [f for f in sorted(path.rglob("*")) if f.is_file() and f"zero_pp_rank_{rank}_" in f.name]
        if rank == 0:  # the files of no rank in particular (mp_rank_00_model_states.pt, zero_to_fp32.py)
            mine += [f for f in sorted(path.rglob("*")) if f.is_file() and "zero_pp_rank_" not in f.name]
        return mine
    return write_full(path, *full_state(stage, model))


def full_state(stage: int, model: Any) -> tuple[dict, dict]:
    """The engine's state whole on rank 0 in torch's state-dict layout (what ``get_state_dict(full_state_dict)``
    gives a torch optimizer's user; other ranks: empty dicts): ``model`` each parameter's fp32 master by name and
    the module's persistent buffers; ``optim`` ``state`` each trained parameter's moments and Adam's ``step`` (the
    one step of the flat partitions, which every sub-group takes together) and ``param_groups`` (the torch
    optimizer's hyper-parameters, the parameters by name). A collective at stages 1-3."""
    rank = dist.get_rank()
    base = _base_optimizer(model)
    keys = _moment_keys(base)
    masters = _stage0_masters(model) if stage == 0 else {}
    weights: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.module.named_parameters():  # every rank, same order: stages 1-3 each a collective
        if not p.requires_grad:  # frozen: no master, no moments; as the module holds it (whole_model_state)
            if hasattr(p, "ds_id"):  # stage 3 partitions it too: gathered, in its own dtype (a collective)
                import deepspeed

                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    if rank == 0:
                        weights[name] = p.data.detach().to("cpu", copy=True).view(_full_shape(p))
            continue
        w, m = _full_fp32_state(p, keys, base, masters)
        if rank == 0:
            shape = _full_shape(p)
            weights[name] = w.detach().to("cpu", torch.float32, copy=True).view(shape)
            moments[name] = {k: v.detach().to("cpu", copy=True).view(shape) for k, v in m.items()}
    if rank != 0:
        return {}, {}
    steps = {float(base.state[q]["step"]) for q in _flat_partitions(model) if "step" in base.state.get(q, {})}
    if len(steps) > 1:
        raise RuntimeError(f"DeepSpeed's flat partitions took different steps ({sorted(steps)}): no one Adam step "
                           "per parameter to write")
    step = next(iter(base.state[q]["step"] for q in _flat_partitions(model) if "step" in base.state.get(q, {})),
                None)
    state = {n: {**m, **({"step": step.detach().to("cpu", copy=True)} if step is not None else {})}
             for n, m in moments.items() if m}
    return whole_model_state(model.module, weights), optim_by_name(state, base.param_groups[0],
                                                                   [n for n in weights if n in state])


def load(stage: int, kind: str, path: Path, model: Any) -> None:
    """Restore a :func:`save` directory into a fresh engine ``model`` (same stage and world size). A collective."""
    if kind == "sharded":
        loaded, _ = model.load_checkpoint(str(path), tag=DS_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=False, load_module_strict=True)
        if loaded is None:
            raise RuntimeError(f"{path}: DeepSpeed found no checkpoint with tag {DS_TAG!r}")
        return
    from deepspeed.utils import (safe_set_full_fp32_param, safe_set_full_optimizer_state, safe_set_local_fp32_param,
                                 safe_set_local_optimizer_state)

    full = read_full(path)  # torch's state-dict layout: any strategy's full checkpoint (full_state)
    named = dict(model.module.named_parameters())
    if not set(named) <= set(full["model"]):
        raise RuntimeError(f"{path / DS_FULL_FILE}: parameters {sorted(set(named) - set(full['model']))} of the "
                           "model are not in the checkpoint")
    state = full["optim"]["state"]
    keys = sorted({k for s in state.values() for k in s if k != "step"})
    if stage == 3:  # the compute parameters: the fp32 master cast, as DeepSpeed's step makes them
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(named.values()), modifier_rank=0), torch.no_grad():
            if dist.get_rank() == 0:  # leaving the context re-partitions rank 0's values to every rank
                for name, p in named.items():
                    p.data.copy_(full["model"][name].to(p.dtype).view_as(p.data))
    else:  # whole on every rank (stages 1, 2: views into bit16_groups_flat): every rank sets its own copy
        with torch.no_grad():
            for name, p in named.items():
                p.data.copy_(full["model"][name].to(p.dtype).view_as(p.data))
    base = _base_optimizer(model)
    # one Adam step for every flat partition (DeepSpeed steps them together): the checkpoint's latest (a parameter
    # another strategy gave its first gradient later holds fewer); none before the first step
    step = latest_step(state)
    for q in _flat_partitions(model) if step is not None else ():  # a fresh optimizer has no state until a step
        held = base.state[q]
        held["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
        for k in keys:
            held[k] = torch.zeros_like(q, memory_format=torch.preserve_format)
    # Stages 1, 2 (and the BF16 optimizer) link each parameter's fragment to the moment tensors only after the
    # first step (_lazy_init_hp_params_optimizer_state): link them to the state just made, as that step would.
    link_optimizer_state(model.optimizer)  # zeroexp._lib.deepspeed_internals
    masters = _stage0_masters(model) if stage == 0 else {}
    for name, p in named.items():
        w, m = full["model"][name], {k: v for k, v in state.get(name, {}).items() if k != "step"}
        if not p.requires_grad:  # frozen: set above with the compute parameters; no master, no moments
            continue
        if hasattr(p, "ds_id"):  # stage 3: this rank's slice of the padded partitions, through the local API
            safe_set_local_fp32_param(p, _own_partition(p, w))
            for k, v in m.items():
                safe_set_local_optimizer_state(p, _own_partition(p, v), k)
            continue
        if _is_deepspeed_partitioned(p):
            safe_set_full_fp32_param(p, w.to(p.device).flatten())
            for k, v in m.items():
                safe_set_full_optimizer_state(p, v.to(p.device).flatten(), k)
            continue
        master = masters.get(id(p), p)  # stage 0: the tensor the torch optimizer steps (p itself in fp32)
        with torch.no_grad():
            if master is not p:
                master.copy_(w.to(master.dtype).view_as(master))
            for k, v in m.items():
                base.state[master][k].copy_(v.view_as(master))


def _own_partition(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """ZeRO-3: this rank's partition of the full tensor ``full`` of parameter ``p``, as DeepSpeed pads it (each of
    the N ranks ``partition_numel()`` elements, the last ones zero beyond ``ds_numel``). Not ``safe_set_full_*``:
    DeepSpeed 0.19.8's stage-3 ``set_full_hp_param`` takes the unpadded tensor and narrows it at rank x partition,
    past its end on the last rank whenever N does not divide the parameter (stage3.py ``set_full_hp_param``; a
    64 x 64 weight at N=3: 1366 x 3 = 4098 > 4096)."""
    size = p.partition_numel()
    rank, n = dist.get_rank(group=p.ds_process_group), dist.get_world_size(group=p.ds_process_group)
    padded = torch.zeros(size * n, dtype=full.dtype)
    padded[:full.numel()] = full.flatten()
    return padded.narrow(0, rank * size, size).to(p.ds_tensor.device)


def _is_deepspeed_partitioned(p: torch.Tensor) -> bool:
    """Whether ``deepspeed.utils.safe_get_full_*`` knows the parameter: ZeRO-3 (``ds_id``) or linked to the fp32
    partition of the stage 1/2 or BF16 optimizer (``_hp_mapping``, set on every parameter, None where this rank
    holds none of it); stage 0 parameters have neither (the safe_get functions return None for them)."""
    return hasattr(p, "ds_id") or linked_to_fp32_partition(p)


def _full_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's full shape (ZeRO-3: ``ds_shape``; the local tensor is empty outside a gather)."""
    return p.ds_shape if hasattr(p, "ds_id") else p.shape


def _full_fp32_state(p: torch.Tensor, keys: list[str], base: torch.optim.Optimizer,
                     masters: dict[int, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The parameter's fp32 master and its moments, full (every rank must call it: stages 1-3 are collectives).

    Stages 1-3: ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (stage 3 all-gathers the
    partitions; stages 1, 2 all-reduce a zero buffer into which each rank copied its fragment). Stage 0 keeps
    everything replicated: the tensor the torch optimizer updates and its state, read directly, no collective. A
    parameter no optimizer holds (frozen; stages 0-2 keep it whole on every rank): itself, no moments.
    """
    if _is_deepspeed_partitioned(p):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        return safe_get_full_fp32_param(p), {k: safe_get_full_optimizer_state(p, k) for k in keys}
    master = masters.get(id(p), p)
    state = base.state.get(master, {})
    return master, {k: state[k] for k in keys if k in state}


def _stage0_masters(engine: Any) -> dict[int, torch.Tensor]:
    """Stage 0: for each module parameter (by id), the tensor whose state the torch optimizer keeps.

    fp32: DeepSpeed hands the client optimizer through unwrapped, its state is keyed by the parameters. bf16 / fp16:
    ``FP16_UnfusedOptimizer`` keeps one fp32 copy per parameter (``fp32_groups`` beside ``fp16_groups``) and the
    client optimizer steps those.
    """
    opt = engine.optimizer
    if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups") and not hasattr(opt, "fp32_groups_flat"):
        return {id(p): q for lp, hp in zip(opt.fp16_groups, opt.fp32_groups) for p, q in zip(lp, hp)}
    if not isinstance(opt, torch.optim.Optimizer):
        raise NotImplementedError(f"DeepSpeed stage 0 with {type(opt).__name__}: where its fp32 master lives is "
                                  "not known to zeroexp")
    return {id(p): p for group in opt.param_groups for p in group["params"]}


def _base_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The client torch optimizer inside the engine's ZeRO optimizer (its state is keyed by the flat fp32
    partitions)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _flat_partitions(engine: Any) -> list[torch.Tensor]:
    """The keys of the torch optimizer's state: stages 1-3 the rank's flat fp32 master partitions (one per
    sub-group), stage 0 the tensors it steps (the parameters, or the FP16 optimizer's fp32 copies), in group order."""
    opt = engine.optimizer
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        if hasattr(opt, attr):
            return list(getattr(opt, attr))
    return [q for group in _base_optimizer(engine).param_groups for q in group["params"]]


def _moment_keys(base: torch.optim.Optimizer) -> list[str]:
    """The element-wise state keys of the torch optimizer (AdamW: ``exp_avg``, ``exp_avg_sq``), from its first state."""
    for state in base.state.values():
        return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return []


def sharded_unreadable(path: Path) -> str | None:
    """Why :func:`read_sharded_whole` cannot read a DeepSpeed sharded checkpoint (None: it can): stage 0's, which has
    no partitions (its module file is the state, DeepSpeed's own), and one with frozen parameters (their fragments
    are written apart from the partitions)."""
    tag = path / DS_TAG
    if not list(tag.glob("*zero_pp_rank_*_optim_states.pt")):  # bf16_zero_pp_rank_... with bf16
        return ("a DeepSpeed stage 0 sharded checkpoint (no partitions to merge): only DeepSpeed restores it; write "
                "checkpoint=full for one that moves")
    states = sorted(tag.glob("*model_states.pt"))
    if not states or torch.load(states[0], map_location="cpu", weights_only=False).get("frozen_param_shapes"):
        return ("frozen parameters, whose fragments DeepSpeed writes apart from its partitions: write "
                "checkpoint=full for a checkpoint that moves")
    return None


def read_sharded_whole(path: Path) -> dict:
    """:func:`_read_sharded_whole`, DeepSpeed's log lines on stderr: unpickling its files imports DeepSpeed, whose
    logger writes to the stdout of its import (``python -m zeroexp.checkpoint convert`` answers on stdout)."""
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):
        return _read_sharded_whole(path)


def _read_sharded_whole(path: Path) -> dict:
    """A DeepSpeed ``sharded`` checkpoint (stages 1-3) read whole, in torch's state-dict layout (``{"model", "optim"}``
    as :func:`full_state` writes it), in this process alone: DeepSpeed's own ``ds_to_universal`` (run as its documented
    command, ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``) merges every rank's padded
    partitions into each parameter's fp32 value and moments (``zero/<name>/fp32.pt``, ``exp_avg.pt``,
    ``exp_avg_sq.pt``, ``step.pt`` at stages 1-2; stage 3's step in ``zero/optimizer_state.pt``), shaped here by the
    checkpoint's ``param_shapes``; buffers and a tied parameter's other names (``shared_params``) from the model
    states. Refuses (CheckpointError) stage 0 (no partitions to merge: its module file is the state) and frozen
    parameters (their fragments are written apart)."""
    import subprocess
    import sys
    import tempfile

    from zeroexp.cell.source import CheckpointError

    why = sharded_unreadable(path)
    if why:
        raise CheckpointError(f"{path}: {why}")
    tag = path / DS_TAG
    model_states = torch.load(sorted(tag.glob("*model_states.pt"))[0], map_location="cpu", weights_only=False)
    with tempfile.TemporaryDirectory(prefix="zeroexp-universal-") as scratch:
        out = Path(scratch) / "universal"
        done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
                               "--output_folder", str(out), "--inject_missing_state"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            raise CheckpointError(f"{path}: DeepSpeed's ds_to_universal failed (exit {done.returncode}): "
                                  + (done.stdout.strip().splitlines() or ["no output"])[-1])
        zero = out / "zero"
        common = torch.load(zero / "optimizer_state.pt", map_location="cpu", weights_only=False)
        shapes = {n: s for group in model_states["param_shapes"] for n, s in group.items()}
        step = next((s["step"] for s in common.get("optimizer_state_dict", {}).get("state", {}).values()
                     if "step" in s), None)
        model: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, shape in shapes.items():
            part = {k: _universal(zero / name / f"{k}.pt") for k in ("fp32", "exp_avg", "exp_avg_sq", "step")
                    if (zero / name / f"{k}.pt").is_file()}
            model[name] = part.pop("fp32").view(shape)
            held = part.pop("step", step)
            state[name] = {**{k: v.view(shape) for k, v in part.items()},
                           **({"step": torch.as_tensor(held, dtype=torch.float32).clone()} if held is not None else {})}
    for alias, name in (model_states.get("shared_params") or {}).items():
        model[alias] = model[name]
    for name in model_states.get("buffer_names") or ():
        model[name] = model_states["module"][name].to("cpu")
    return {"model": model, "optim": optim_by_name(state, common["param_groups"][0], list(shapes))}


def _universal(file: Path) -> torch.Tensor:
    """One tensor of a universal checkpoint: stages 1-2 write ``{"param": tensor, "cat_dim": 0}``, stage 3 the flat
    tensor itself."""
    held = torch.load(file, map_location="cpu", weights_only=False)
    return (held["param"] if isinstance(held, dict) else held).detach()


class DeepSpeedCheckpoints:
    """The DeepSpeed adapter's checkpoints (its ``stage``), before ``StrategyAdapter`` in its bases: save and load
    both kinds, the full state whole on rank 0, and a sharded checkpoint read whole offline (DeepSpeed's
    ``ds_to_universal``: ``python -m zeroexp.checkpoint convert`` moves it into torch's layout)."""

    stage: int

    def checkpoint_format(self, kind: str) -> str:
        return checkpoint_format(self.stage, kind)

    def save_checkpoint(self, kind: str, path: Path, model: Any, optimizer: Any) -> list[Path]:
        return save(self.stage, kind, path, model)

    def load_checkpoint(self, kind: str, path: Path, model: Any, optimizer: Any) -> None:
        load(self.stage, kind, path, model)

    def full_state_dicts(self, model: Any, optimizer: Any) -> tuple[dict, dict]:
        return full_state(self.stage, model)

    @classmethod
    def unreadable(cls, kind: str, path: Path) -> str | None:
        return sharded_unreadable(path) if kind == "sharded" else super().unreadable(kind, path)  # type: ignore[misc]

    @classmethod
    def read_whole(cls, kind: str, path: Path) -> dict:
        return read_sharded_whole(path) if kind == "sharded" else super().read_whole(kind, path)  # type: ignore[misc]
