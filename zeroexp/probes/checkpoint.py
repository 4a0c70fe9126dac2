"""What a checkpoint costs and whether it restores exactly: ``checkpoint.csv`` and ``summary.json[checkpoint]``.

With ``checkpoint=full`` or ``checkpoint=sharded`` the probe runs once training is over (``on_train_end``,
after the equivalence probe, so no measured step and no other probe sees it), on every rank:

1. **save**: the adapter's ``save_checkpoint(kind, dir, model, optimizer)`` (the adapter knows how its
   strategy saves; full: everything gathered to rank 0, sharded: each rank its own part) with the torch
   profiler (collectives, counted by :func:`zeroexp.probes.collectives.extract`) and the memory probe's
   tracker (:func:`zeroexp.probes.memory.memory_source`) running: wall time, files and bytes written, the
   collectives issued, the bytes held when the save started and the peak during it.
2. **meta.json**: rank 0 records kind, strategy, world size, the step, the cell's configuration
   (zeroexp.cell.source.CELL_KEYS) and every file's size and SHA-256, last: a directory without it is an unfinished
   save.
3. **load**: a fresh model (another seed, so every tensor must come from the checkpoint), wrapped by the
   adapter, and its optimizer. :func:`verify_checkpoint` refuses a checkpoint of another kind or strategy, a
   sharded one of another world size, and a missing, truncated or altered file (:class:`CheckpointError`);
   then the adapter's ``load_checkpoint``, measured like the save.
4. **continuation**: the restored parameters against the saved ones, bit for bit; then one more step (the
   batches of step ``steps``) on the trained model and on the restored one, and the parameters again.

With ``checkpoint.load_from`` (any ``checkpoint``, ``none`` included: zeroexp.config.moves), before the first step
(``on_train_start``): the checkpoint, written by any strategy of the cell's layout at any world size, loaded by the
adapter's ``load_checkpoint`` (measured as a restore), then the state the cell holds gathered whole to rank 0 and
compared with the checkpoint's own, read whole there (:func:`moved_state`): ``summary.json[checkpoint][moved]``. That
training resumed from it matches the target configuration's uninterrupted run from the same state is the
equivalence probe's check: its reference starts from the checkpoint (zeroexp.probes.equivalence.train_reference).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pandas as pd
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.profiler import ProfilerActivity, profile

from zeroexp.cell.identity import strategy_label
from zeroexp.cell.source import FORMAT, META, CheckpointError, Source, cell_record, file_sha256, verify_checkpoint
from zeroexp.models import build_model, make_batch
from zeroexp.probes.base import Probe, ProbeReport
from zeroexp.probes.collectives import SOURCE as COLLECTIVES_SOURCE
from zeroexp.probes.collectives import GroupMarks, extract
from zeroexp.probes.memory import memory_source
from zeroexp.probes.payload import files_payload
from zeroexp.results.files import write_json
from zeroexp.results.cells import column
from zeroexp.results.format import byte_unit, fmt_err, fmt_int, fmt_ms, missing
from zeroexp.results.section import OPS, Column, ReportTable, raw_rows
from zeroexp.results.verdict import Check, Code, Reason

if TYPE_CHECKING:
    from zeroexp.models.module import CellModule

__all__ = ["CheckpointProbe", "CheckpointError", "verify_checkpoint", "META", "FORMAT"]

COLUMNS = ["rank", "phase", "ms", "bytes_written", "start_bytes", "peak_bytes", "peak_over_start_bytes",
           "collective_calls", "collective_payload_bytes"]


def _measured(fn: Callable[[], Any], device: torch.device, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer, world_size: int,
              mesh_dims: dict[str, str] | None = None) -> tuple[Any, dict[str, Any]]:
    """Run ``fn`` (a collective) with the profiler and the memory tracker; its result and its measurement. Each
    collective's payload is sized by its process group (GroupMarks; ``mesh_dims``: the adapter's, hybrid sharding)."""
    tracker = memory_source(device)
    dist.barrier()  # every rank starts together: the time is the save's, not the wait for a slower rank
    tracker.begin(model, optimizer)
    start = tracker.current_bytes()
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    prof.start()
    try:
        t0 = time.perf_counter()
        with GroupMarks():
            out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - t0) * 1e3
    except BaseException:
        prof.stop()
        tracker.abort()
        raise
    prof.stop()
    memory = tracker.end(model, optimizer)
    counts: dict[str, int] = {}
    payload: dict[str, int] = {}
    for rec in extract(prof, [0], world_size, mesh_dims):
        counts[rec["op"]] = counts.get(rec["op"], 0) + rec["count"]
        payload[rec["op"]] = payload.get(rec["op"], 0) + rec["payload_bytes"]
    return out, {"ms": ms, "start_bytes": start, "peak_bytes": memory["peak"],
                 "peak_over_start_bytes": memory["peak"] - start, "counts": counts, "payload_bytes": payload,
                 "memory_source": tracker.source}


def checkpoint_table(ok: pd.DataFrame) -> ReportTable | None:
    """Save and restore of the cells run with ``checkpoint=full|sharded``: bytes, rank 0's and the largest save
    peak above what the rank held, the save's collectives, times, the bit-identical continuation; else None."""
    has = [not missing(v) for v in column(ok, "checkpoint.kind")]
    if not any(has):
        return None
    ok = ok[has]
    ops = sorted({k.split(".")[-1] for k in ok.columns if k.startswith("checkpoint.save.collectives.counts.")},
                 key=lambda op: (list(OPS).index(op) if op in OPS else len(OPS), op))
    keys = ["checkpoint.kind", "checkpoint.files", "checkpoint.save.bytes_written",
            "checkpoint.save.rank0_peak_over_start_bytes", "checkpoint.save.max_peak_over_start_bytes",
            "checkpoint.save.ms", "checkpoint.load.ms", "checkpoint.continuation_max_abs_diff", "checkpoint.check"]
    moved = ["checkpoint.moved.source.strategy", "checkpoint.moved.source.world_size", "checkpoint.moved.source.step",
             "checkpoint.moved.bit_identical_tensors", "checkpoint.moved.compared_tensors"]
    raw = raw_rows(ok, keys + [f"checkpoint.save.collectives.counts.{op}" for op in ops]
                   + [k for k in moved if k in ok.columns])
    raw["started from"] = ["none" if missing(row.get(moved[0])) else
                           f"{row[moved[0]]} N={fmt_int(row[moved[1]])} step {fmt_int(row[moved[2]])}: "
                           f"{fmt_int(row[moved[3]])} of {fmt_int(row[moved[4]])} tensors bit-identical"
                           for _, row in raw.iterrows()]
    raw["save collectives"] = [", ".join(f"{OPS.get(op, op)} {fmt_int(row[f'checkpoint.save.collectives.counts.{op}'])}"
                                         for op in ops if not missing(row[f"checkpoint.save.collectives.counts.{op}"]))
                               or "none" for _, row in raw.iterrows()]
    unit = byte_unit(v for k in keys[2:5] for v in raw[k])
    cols = [Column("cell", "label", str), Column("kind", keys[0]), Column("files", keys[1], fmt_int),
            Column(f"written {unit}", keys[2], unit), Column(f"rank-0 save peak + {unit}", keys[3], unit),
            Column(f"max save peak + {unit}", keys[4], unit), Column("save collectives", "save collectives", str),
            Column("save ms", keys[5], fmt_ms), Column("load ms", keys[6], fmt_ms),
            Column("continuation max abs diff", keys[7], fmt_err), Column("started from", "started from", str),
            Column("check", keys[8])]
    note = (f"After training: bytes written by all ranks; save peak + is the highest allocation during the save "
            f"above what the rank held when it started ({unit}; rank 0, and the largest rank); the save's collectives "
            "(rank 0's calls, torch.profiler); times with the profiler and memory tracker running. PASS: restored into "
            "a fresh model, one more step gives bit-identical parameters; a cell started from a checkpoint "
            "(checkpoint.load_from): the writing strategy, N and step, and its tensors held bit-identical after the "
            "move.")
    return ReportTable("checkpoint", "Checkpoint: save and restore", raw, cols, note)


def checkpoint_line(c: dict[str, Any]) -> str:
    parts = []
    moved = c.get("moved")
    if moved:
        src = moved.get("source", {})
        parts.append(f"started from step {src.get('step')} of a {src.get('kind')} checkpoint by {src.get('strategy')} "
                     f"at N={src.get('world_size')}: {moved.get('bit_identical_tensors')} of "
                     f"{moved.get('compared_tensors')} tensors bit-identical"
                     + (f", {len(moved['cast'])} cast" if moved.get("cast") else ""))
    if "save" in c:
        save, load = c.get("save", {}), c.get("load", {})
        parts.append(f"{c.get('kind')}: {c.get('files')} files saved in {fmt_ms(save.get('ms'))} ms, restored in "
                     f"{fmt_ms(load.get('ms'))} ms; restored and continued bit for bit: "
                     f"{c.get('restored_bit_identical')} / {c.get('continuation_bit_identical')}")
    return "; ".join(parts)


class CheckpointProbe(Probe):
    """Saves after training, restores into a fresh model, checks that training continues bit-identically."""

    name = "checkpoint"
    order = 80
    always = False  # runs with checkpoint other than none (Probe.runs)
    dry_run_absent = "no checkpoint: a dry run holds no tensor values to save (dry_run=true refuses checkpoint)"

    @classmethod
    def runs(cls, cell: Any) -> bool:
        return cell.checkpoint != "none" or cell.load_from is not None

    digest_line = staticmethod(checkpoint_line)
    report_table = staticmethod(checkpoint_table)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.kind = str(ctx.cfg.checkpoint.name)
        self.result: dict[str, Any] = {}
        self.moved: dict[str, Any] | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        """``checkpoint.load_from``: before the first step, the checkpoint loaded into the wrapped model and its
        optimizer by the adapter's own load (measured as a restore is), then the state it holds gathered whole and
        compared with the checkpoint's, read whole on rank 0 (:func:`moved_state`)."""
        source = self.ctx.cell.load_from
        if source is None:
            return
        adapter, device, n = self.ctx.adapter, self.ctx.device, self.ctx.world_size
        model, optimizer = trainer.strategy.model, trainer.optimizers[0]
        _, load = _measured(lambda: adapter.load_checkpoint(source.kind, Path(source.dir), model, optimizer),
                            device, model, optimizer, n, adapter.mesh_dims())
        held = adapter.full_state_dicts(model, optimizer)  # a collective: the state whole on rank 0
        self.moved = {"source": source.record(), "target_label": strategy_label(self.ctx.cfg), "load": load,
                      "not_moved": not_moved(source, self.ctx.cell),
                      **(moved_state(adapter.read_whole(source.kind, Path(source.dir)), *held)
                         if self.ctx.rank == 0 else {})}

    def _directory(self, trainer) -> Path:
        where = self.ctx.cfg.checkpoint.get("dir")
        return Path(where) if where else Path(trainer.default_root_dir) / "checkpoint"

    def _fresh(self) -> tuple[torch.nn.Module, CellModule, torch.optim.Optimizer]:
        """A new model with other initial weights, wrapped by the adapter, and its optimizer (as Lightning builds
        it)."""
        cfg, adapter = self.ctx.cfg, self.ctx.adapter
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(cfg.seed) + 1)
            net = build_model(OmegaConf.to_container(cfg.model, resolve=True))
        # a LightningModule: imported here, so the probe's module needs no Lightning
        from zeroexp.models.module import CellModule

        module = CellModule(net, cfg.model.loss, adapter.make_optimizer, adapter.clip_gradients).to(self.ctx.device)
        model = adapter.wrap_cell(module, self.ctx.device)  # as the cell's model: checkpointed units too
        return model, module, module.configure_optimizers()

    def _compare(self, a: torch.nn.Module, b: torch.nn.Module) -> dict[str, Any]:
        """Rank 0: whether every full parameter of ``a`` equals ``b``'s bit for bit (a collective for sharded
        models)."""
        full: list[dict[str, torch.Tensor]] = []
        for model in (a, b):
            with self.ctx.adapter.full_parameters(model) as params:
                full.append({n: t.to("cpu", copy=True) for n, t in params.items()} if self.ctx.rank == 0 else {})
        if self.ctx.rank != 0:
            return {}
        x, y = full
        if set(x) != set(y):
            return {"bit_identical": False, "max_abs_diff": None, "compared_tensors": 0}
        diff = max((float((x[n] - y[n]).abs().max()) if x[n].numel() else 0.0 for n in x), default=0.0)
        return {"bit_identical": all(torch.equal(x[n], y[n]) for n in x), "max_abs_diff": diff,
                "compared_tensors": len(x)}

    def on_train_end(self, trainer, pl_module) -> None:
        if self.kind != "none":
            self._save_and_restore(trainer, pl_module)

    def _save_and_restore(self, trainer, pl_module) -> None:
        cfg, adapter, rank, n = self.ctx.cfg, self.ctx.adapter, self.ctx.rank, self.ctx.world_size
        path = self._directory(trainer)
        model, optimizer, device = trainer.strategy.model, trainer.optimizers[0], self.ctx.device
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # an earlier attempt's files are not this save's
            path.mkdir(parents=True)
        dist.barrier()
        files, save = _measured(lambda: adapter.save_checkpoint(self.kind, path, model, optimizer),
                                device, model, optimizer, n, adapter.mesh_dims())
        mine = [{"name": f.relative_to(path).as_posix(), "bytes": f.stat().st_size, "sha256": file_sha256(f),
                 "rank": rank} for f in files]
        written: list[Any] = [None] * n
        dist.all_gather_object(written, mine)
        if rank == 0:
            write_json(path / META, {"format": FORMAT, "kind": self.kind, "strategy": cfg.strategy.name,
                                     "strategy_label": strategy_label(cfg), "world_size": n,
                                     "step": self.ctx.cell.first_step + int(trainer.global_step),
                                     "cell": cell_record(cfg),
                                     "files": [f for per_rank in written for f in per_rank]})
        dist.barrier()
        payload = files_payload(path, [f["name"] for f in mine])  # the tensors' bytes of this rank's files
        fresh, fresh_module, fresh_optimizer = self._fresh()
        refusals: list[Any] = [None] * n
        try:
            verify_checkpoint(path, kind=self.kind, strategy=cfg.strategy.name, world_size=n,
                              hash_files=[f["name"] for f in mine])
            refusal = None
        except CheckpointError as e:
            refusal = str(e)
        dist.all_gather_object(refusals, refusal)
        if any(refusals):  # every rank refuses, with the first reason
            raise CheckpointError(next(r for r in refusals if r))
        _, load = _measured(lambda: adapter.load_checkpoint(self.kind, path, fresh, fresh_optimizer),
                            device, fresh, fresh_optimizer, n, adapter.mesh_dims())
        restored = self._compare(model, fresh)
        step = self.ctx.cell.first_step + int(trainer.global_step)  # the batches of the step after the last
        batch = make_batch(OmegaConf.to_container(cfg.model, resolve=True), int(cfg.batch_size), int(cfg.seed), step,
                           rank).to(device)
        adapter.settle_restored(fresh, fresh_module.loss_fn, batch)  # e.g. DDP's bucket layout after a first step
        adapter.train_step(model, pl_module.loss_fn, optimizer, batch)  # the adapter's step (DeepSpeed: the engine's)
        adapter.train_step(fresh, fresh_module.loss_fn, fresh_optimizer, batch)
        continued = self._compare(model, fresh)
        keep = bool(cfg.checkpoint.keep)
        dist.barrier()
        if rank == 0 and not keep:
            shutil.rmtree(path, ignore_errors=True)
        self.result = {"kind": self.kind, "format": adapter.checkpoint_format(self.kind), "files": mine,
                       "payload_bytes": payload,
                       "save": save, "load": load, "restored": restored, "continued": continued,
                       "continuation_step": step, "kept": keep,
                       "directory": _shown(path, Path(trainer.default_root_dir)) if keep else None}

    def rank_result(self) -> dict[str, Any]:
        return {**self.result, **({"moved": self.moved} if self.moved is not None else {})}

    @classmethod
    def aggregate(cls, results: list[dict[str, Any]], cell) -> ProbeReport:
        first = results[0]
        phases = {**({"move": lambda r: r["moved"]["load"]} if "moved" in first else {}),
                  **({"save": lambda r: r["save"], "load": lambda r: r["load"]} if "save" in first else {})}
        rows = []
        for rank, res in enumerate(results):
            for phase, of in phases.items():
                m = of(res)
                rows.append({"rank": rank, "phase": phase, "ms": m["ms"],
                             "bytes_written": sum(f["bytes"] for f in res["files"]) if phase == "save" else 0,
                             "start_bytes": m["start_bytes"], "peak_bytes": m["peak_bytes"],
                             "peak_over_start_bytes": m["peak_over_start_bytes"],
                             "collective_calls": sum(m["counts"].values()),
                             "collective_payload_bytes": sum(m["payload_bytes"].values())})
        frame = pd.DataFrame(rows, columns=COLUMNS)
        reasons: list[Reason] = []
        section: dict[str, Any] = {"kind": cell.checkpoint}
        if "moved" in first:
            moved = {**first["moved"], "load": _phase(results, frame, "move", phases["move"])}
            reasons += moved_reasons(moved)
            section["moved"] = {**moved, **Check.failed_if(moved_reasons(moved)).fields()}
        if "save" in first:
            restored, continued = first["restored"], first["continued"]
            if not restored.get("bit_identical"):
                reasons.append(Reason(Code.CHECKPOINT_RESTORE_DIFFERS,
                                      "the restored parameters differ from the saved ones"))
            if not continued.get("bit_identical"):
                reasons.append(Reason(Code.CHECKPOINT_CONTINUATION_DIFFERS, "one more step after the restore differs "
                                      f"from one more step without it (max abs diff {continued.get('max_abs_diff')})"))
            section.update({
                "format": first["format"], "kept": first["kept"], "directory": first["directory"],
                "files": sum(len(r["files"]) for r in results),
                "save": {**_phase(results, frame, "save", phases["save"]),
                         "bytes_written": int(sum(sum(f["bytes"] for f in r["files"]) for r in results)),
                         "rank_bytes_written": [int(sum(f["bytes"] for f in r["files"])) for r in results],
                         "payload_bytes": int(sum(r["payload_bytes"] for r in results)),
                         "rank_payload_bytes": [int(r["payload_bytes"]) for r in results]},
                "load": _phase(results, frame, "load", phases["load"]),
                "memory_source": first["save"]["memory_source"], "collectives_source": COLLECTIVES_SOURCE,
                "restored_bit_identical": bool(restored.get("bit_identical")),
                "continuation_step": first["continuation_step"],
                "continuation_bit_identical": bool(continued.get("bit_identical")),
                "continuation_max_abs_diff": continued.get("max_abs_diff"),
                "compared_tensors": continued.get("compared_tensors")})
        section.update(Check.failed_if(reasons).fields())
        return ProbeReport(section=section, tables={"checkpoint.csv": frame})


def state_tensors(model_sd: dict, optim_sd: dict) -> dict[str, torch.Tensor]:
    """A state's tensors by name: each model entry by its name, each optimizer entry ``<parameter>:<key>``
    (``exp_avg``, ``exp_avg_sq``, ``step``; a number as a tensor)."""
    out = {str(n): t for n, t in model_sd.items() if isinstance(t, torch.Tensor)}
    for name, entry in (optim_sd.get("state") or {}).items():
        for key, value in entry.items():
            out[f"{name}:{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


def moved_state(whole: dict, model_sd: dict, optim_sd: dict) -> dict[str, Any]:
    """Rank 0: the state a cell holds after loading a checkpoint (``model_sd`` and ``optim_sd`` whole, as a full
    checkpoint would write them) against the checkpoint's own, read whole (``whole``: ``StrategyAdapter.read_whole``,
    in this process): every tensor of the checkpoint by
    name, equal bit for bit where its dtype did not change; ``cast``: those that changed dtype (what the cast
    lost: their largest difference); ``lost``: tensors of the checkpoint the cell holds none of; ``initialised``:
    optimizer state the cell holds and the checkpoint has none of, all zero (torch's state-dict API creates every
    trainable parameter's state by a step of zero gradients at lr 0 before it loads: a parameter no step had given
    a gradient yet); ``added``: any other tensor the checkpoint lacks."""
    theirs, ours = state_tensors(whole["model"], whole["optim"]), state_tensors(model_sd, optim_sd)
    common = [k for k in theirs if k in ours]
    differ, cast, worst = [], [], 0.0
    for name in common:
        a, b = theirs[name], ours[name].to("cpu")
        if a.shape != b.shape:
            differ.append({"tensor": name, "why": f"shape {tuple(b.shape)}, the checkpoint's {tuple(a.shape)}"})
            continue
        diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        worst = max(worst, diff)
        if a.dtype != b.dtype:
            cast.append({"tensor": name, "from": str(a.dtype).removeprefix("torch."),
                         "to": str(b.dtype).removeprefix("torch."), "max_abs_diff": diff})
        elif not torch.equal(a, b):
            differ.append({"tensor": name, "why": f"max abs diff {diff:.3g}"})
    extra = [k for k in ours if k not in theirs]
    zero = [k for k in extra if ":" in k and not k.endswith(":step") and not bool(ours[k].count_nonzero())]
    fresh = {k.split(":")[0] for k in zero}
    initialised = sorted(k for k in extra if k in zero or (k.endswith(":step") and k.split(":")[0] in fresh))
    return {"compared_tensors": len(common), "bit_identical_tensors": len(common) - len(differ) - len(cast),
            "max_abs_diff": worst, "differ": differ, "cast": cast, "lost": sorted(k for k in theirs if k not in ours),
            "initialised": initialised, "added": sorted(k for k in extra if k not in initialised)}


def not_moved(source: Source, cell: Any) -> list[dict[str, str]]:
    """What of the checkpoint's training a cell that starts from it does not carry on, each ``{state, why}``: none
    but fp16's dynamic loss scale (a checkpoint holds the model's and AdamW's state; the scale a run has grown or
    cut is not in it) and a precision change (each says what its state keeps)."""
    out = []
    if source.cell["precision"].get("loss_scale") is not None:
        out.append({"state": "the fp16 loss scale and its growth count", "why": "not in the checkpoint: the cell "
                    f"starts at precision.loss_scale={cell.policy.precision.loss_scale}"})
    if source.precision != cell.precision:
        out.append({"state": f"precision {source.precision}", "why": f"the cell trains in {cell.precision}: the "
                    "checkpoint's parameters and moments are loaded as the cell holds them (cast lists each tensor "
                    "whose dtype changed: none where both keep fp32 masters)"})
    return out


def moved_reasons(moved: dict[str, Any]) -> list[Reason]:
    """Why a moved state is not the checkpoint's (none: PASS): a tensor that differs without a cast, or one lost
    or added."""
    reasons = []
    if moved.get("differ"):
        reasons.append(Reason(Code.CHECKPOINT_MOVE_DIFFERS, f"{len(moved['differ'])} tensors differ from the "
                              f"checkpoint's with their dtype unchanged, first {moved['differ'][0]['tensor']} "
                              f"({moved['differ'][0]['why']})"))
    if moved.get("lost") or moved.get("added"):
        said = [f"{len(moved[k])} {k} (first {moved[k][0]})" for k in ("lost", "added") if moved.get(k)]
        reasons.append(Reason(Code.CHECKPOINT_MOVE_NAMES_DIFFER, "the moved state's tensors are not the "
                              f"checkpoint's: {', '.join(said)}"))
    return reasons


def _phase(results: list[dict[str, Any]], frame: pd.DataFrame, phase: str,
           of: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """One phase's section: the slowest rank's time, per-rank memory, rank 0's collectives (``of``: a rank's
    measurement of the phase)."""
    rows = frame[frame.phase == phase]
    r0 = of(results[0])
    return {"ms": float(rows.ms.max()), "rank_ms": [float(v) for v in rows.ms],
            "start_bytes": [int(v) for v in rows.start_bytes], "peak_bytes": [int(v) for v in rows.peak_bytes],
            "peak_over_start_bytes": [int(v) for v in rows.peak_over_start_bytes],
            "rank0_peak_bytes": int(r0["peak_bytes"]), "rank0_peak_over_start_bytes": int(r0["peak_over_start_bytes"]),
            "max_peak_over_start_bytes": int(rows.peak_over_start_bytes.max()),
            "collectives": {"counts": dict(r0["counts"]), "payload_bytes": dict(r0["payload_bytes"])},
            "rank_collective_calls": [int(v) for v in rows.collective_calls]}


def _shown(path: Path, cell: Path) -> str:
    """``path`` relative to the cell directory when inside it, else absolute."""
    try:
        return path.resolve().relative_to(cell.resolve()).as_posix()
    except ValueError:
        return str(path.resolve())


# The digest line and the report section (Probe.digest_line, Probe.report_table).


