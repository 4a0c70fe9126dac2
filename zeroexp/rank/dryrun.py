"""``dry_run=true``: the state table and collective fingerprint of a cell at any world size, on one CPU process.

One process plays rank 0 of ``world_size`` ranks under a fake process group (torch's
``init_process_group("fake")``: every collective returns at once, no peer exists) and ``FakeTensorMode`` (tensors
carry shapes, dtypes and storage sizes but no data), so no parameter memory is allocated whatever the model's
size. It writes the same cell directory as a real run, with ``manifest.json`` and ``summary.json`` saying
``mode: dry_run``; what a dry run cannot measure (loss, step time, real memory, equivalence) is absent, and
``summary.json["dry_run"]`` says why.

Two sources, named in ``summary.json["dry_run"]["source"]`` (``StrategyAdapter.dry_run_traced``):

- ``traced`` (FSDP1, FSDP2): the steps run through the real run's loop (zeroexp.rank.fit: Lightning's Trainer,
  the adapter's strategy wrapping the model, forward, backward, AdamW) with the real run's probes as its
  callbacks, on rank 0's batches made real and then faked: the state probe counts rank 0's tensors at
  ``schedule.state_step``, the collectives probe's profiler records ``schedule.profiled``. The device mesh is
  made before ``FakeTensorMode`` is entered (``StrategyAdapter.setup``); the functional collectives DTensor issues
  (FSDP2 clipping's norm) run on the fake process group (:mod:`zeroexp._lib.fake_collectives`), as a real run issues
  them. The memory probe tracks its steps too: its phase peaks are a *simulation* (MemTracker over fake storages: what
  the strategy's code allocates, without the backend's own buffers, which the fake process group does not make), written
  as ``memory`` with ``simulated: true`` and shown beside the peak model's prediction in ``plan.memory``, never as it.
- ``derived`` (DDP, ZeroRedundancyOptimizer, any strategy not traced): DDP's C++ Reducer needs real storage, so
  the model is built on the meta device; the collectives are the adapter's ``expected_collectives`` of that
  groups its row derives from the shapes (DDP's buckets in gradient-ready order, the optimizer's owners:
  ``zeroexp.plan.check.cell.cell_groups``, equal to what the adapter reads in a real run), through
  ``zeroexp.formulas``; the state table is ``rank_state_bytes``, every rank. The plan check then reads n/a.
"""

from __future__ import annotations

import json
import os
import resource
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from zeroexp.plan.check.expect import Expectation
from zeroexp._lib.fake_collectives import IssueFunctionalCollectives
from zeroexp._lib.fake_tensors import fake_tensor_mode, real_tensors
from zeroexp._lib.fsdp2 import fsdp2_chunking, fsdp2_post_forward_mesh_in
from zeroexp._lib.fsdp1 import allocated_by_size
from zeroexp.models import build_model
from zeroexp.models.module import CellModule, SyntheticBatches
from zeroexp.probes import (CollectivesProbe, MemoryProbe, RunContext, StateProbe, absent_in_dry_run, as_callback,
                            probes_for)
from zeroexp.probes.memory import freeze_startup_objects
from zeroexp.probes.state import check_factors
from zeroexp.results.files import write_text
from zeroexp.config.schedule import Schedule
from zeroexp.rank.summary import summary_head, write_summary
from zeroexp.strategies import get_adapter_class

__all__ = ["run_dry", "play_rank0", "SOURCES", "ABSENT", "LazyChunks", "lazy_fsdp2_chunks"]

SOURCES = {
    "traced": "traced: the strategy's own code ran as rank 0 of world_size under a fake process group and "
              "FakeTensorMode; state counted by the state probe, collectives recorded by the collectives probe",
    "derived": "derived: the strategy is not traced (StrategyAdapter.dry_run_traced; DDP's C++ Reducer needs real "
               "storage), so nothing ran; collectives and state table from the groups the strategy's row derives "
               "from the model's shapes (zeroexp.formulas: step_collectives, rank_state_bytes)",
}
#: The sections of a real run that a dry run leaves out, and why (each probe's ``Probe.dry_run_absent``).
ABSENT = absent_in_dry_run()
FACTORS_BASIS = ("rank 0 x world_size: a dry run measures rank 0 only. Exact when every rank holds as much as "
                 "rank 0 (N divides every unit, or every parameter's dim 0 for FSDP2); otherwise above the sum "
                 "over ranks by the padding the last ranks hold instead of parameters. Checked against rank 0's "
                 "bytes by the formulas x world_size (zeroexp.formulas.rank_state_bytes), padding included")
CPU = torch.device("cpu")


def run_dry(cfg_dict: dict[str, Any], cell: Path, run_info: dict[str, Any]) -> dict[str, Any]:
    """Play rank 0 of the cell under a fake process group; write the cell's files; return the summary."""
    warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
    cfg = OmegaConf.create(cfg_dict)
    n = int(cfg.world_size)
    dist.init_process_group("fake", rank=0, world_size=n)  # no store: torch makes the fake backend's own
    try:
        adapter = get_adapter_class(cfg.strategy.name)(cfg)
        ctx = RunContext(cfg=cfg, rank=0, world_size=n, device=CPU, adapter=adapter, schedule=Schedule.from_cfg(cfg),
                         expect=Expectation(cfg, adapter.live_groups))
        source = "traced" if adapter.dry_run_traced else "derived"
        state, collectives, memory, steps = (_traced if source == "traced" else _derived)(cfg, ctx)
        write_text(Path(cell) / ".ranks" / "rank0.json",
                   json.dumps({"state": state, "collectives": collectives, "memory": memory}))
        return _finalize(Path(cell), cfg, run_info, source, state, collectives, steps, ctx.expect.groups_record(),
                         memory)
    finally:
        dist.destroy_process_group()


#: What the memory probe's figures mean in a traced dry run.
SIMULATED = ("simulated: rank 0's steps under FakeTensorMode and a fake process group, tracked by the memory probe's "
             "MemTracker (fake storages, nothing allocated); the backend's own buffers (gloo's or NCCL's copies) are "
             "not in it: the fake process group makes none")


class LazyChunks(Sequence):
    """torch FSDP2's ``_chunk_with_empty(tensor, num_chunks, dim)`` (the ``num_chunks`` shards of a parameter, each
    rank's a view of ``tensor``; empty tensors for the ranks past the last element) as a sequence that makes shard
    ``i`` only when asked. FSDP2 asks for two: the rank's own and shard 0 (the padded size). Under
    ``FakeTensorMode`` each of torch's ``num_chunks`` views is a fake tensor made in Python: at N=1024, made eagerly,
    they cost 56 % of a 4.3e9-parameter dry run (two lists of 1024 per parameter; py-spy). Shard
    ``i`` is ``tensor.narrow(dim, i * s, ...)`` with torch.chunk's size ``s = ceil(size / num_chunks)``, as ATen's
    ``chunk`` (``split``) makes it; tests/test_fsdp2_dry_run.py holds it equal (shape, stride, offset, values) to
    torch's function. Indexing and ``len`` only, as FSDP2 uses it (not a list: no ``torch.cat`` of it)."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self._tensor, self._n, self._dim = tensor, int(num_chunks), int(dim)
        self._size = int(tensor.size(dim))
        self._step = -(-self._size // self._n)  # torch.chunk's chunk size
        self._made = -(-self._size // self._step)  # the chunks torch.chunk returns; the rest are empty

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = range(self._n)[i]  # an IndexError past the end, negative indices as a list's
        if i < self._made:
            start = i * self._step
            return self._tensor.narrow(self._dim, start, min(self._step, self._size - start))
        return self[0].new_empty(0)


@contextmanager
def lazy_fsdp2_chunks() -> Iterator[None]:
    """While a dry run traces FSDP2: its ``_chunk_with_empty`` gives :class:`LazyChunks` for a parameter with at least
    one element along the sharded dim (torch's own function for an empty one), and it builds an int
    ``reshard_after_forward``'s post-forward mesh with real tensors. Restored after. A torch without the module
    (before 2.6, or moved) is left as it is: the dry run runs torch's own path, only slower."""
    def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int, original: Any) -> Any:
        return LazyChunks(tensor, num_chunks, dim) if tensor.size(dim) > 0 else original(tensor, num_chunks, dim)

    # an int reshard_after_forward's post-forward mesh is made of the mesh's real rank tensor (zeroexp._lib.fsdp2)
    with fsdp2_chunking(chunk_with_empty), fsdp2_post_forward_mesh_in(real_tensors):
        yield


def play_rank0(cfg_dict: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Rank 0 of the cell's ``world_size`` played on ``device`` with **real** tensors under the fake process group:
    the traced dry run's steps (:func:`_traced`) without FakeTensorMode, so the rank's shards, unsharded units,
    gradients, buffers and optimizer state are really allocated while every collective returns at once (no peer, no
    backend buffer). On a GPU the memory probe measures one rank of N with the CUDA caching allocator; on the CPU
    with MemTracker. Returns the probes' rank-0 results (``state``, ``collectives``, ``memory``), the memory probe's
    aggregated section as ``memory_section`` (``backend: fake``), and ``steps``."""
    freeze_startup_objects()  # as a rank does: the memory probe's cycle collections walk only what the cell creates
    cfg = OmegaConf.create(cfg_dict)
    n = int(cfg.world_size)
    dist.init_process_group("fake", rank=0, world_size=n)
    try:
        adapter = get_adapter_class(cfg.strategy.name)(cfg)
        if not adapter.dry_run_traced:
            raise ValueError(f"strategy={cfg.strategy.name} is not traced under the fake process group "
                             "(StrategyAdapter.dry_run_traced)")
        ctx = RunContext(cfg=cfg, rank=0, world_size=n, device=device, adapter=adapter,
                         schedule=Schedule.from_cfg(cfg), expect=Expectation(cfg, adapter.live_groups))
        state, collectives, memory, steps = _traced(cfg, ctx, fake=False)
    finally:
        dist.destroy_process_group()
    section = {**MemoryProbe.aggregate([memory], cfg).section, "backend": "fake"} if memory else None
    return {"state": state, "collectives": collectives, "memory": memory, "memory_section": section, "steps": steps}


def _traced(cfg: DictConfig, ctx: RunContext, fake: bool = True
            ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any] | None, int]:
    """Rank 0's steps under FakeTensorMode (``fake``; else real tensors on ``ctx.device``: :func:`play_rank0`),
    trained by the real run's loop (zeroexp.rank.fit: Lightning's Trainer and the adapter's strategy) with the real
    run's state and collectives probes, and the memory probe (its figures simulated under FakeTensorMode: see
    :data:`SIMULATED`) where the cell runs it."""
    import lightning.pytorch as pl

    from zeroexp.rank.fit import fit_cell

    adapter, schedule, n = ctx.adapter, ctx.schedule, ctx.world_size
    adapter.setup(ctx.device)  # e.g. FSDP2's device mesh: real tensors, made before FakeTensorMode
    classes = [cls for cls in probes_for(cfg) if not cls.dry_run_absent]  # the state and collectives probes
    classes += [cls for cls in probes_for(cfg) if cls is MemoryProbe and _simulates_memory(cfg)]
    steps = _steps_read(schedule, classes)  # warm-up and those probes' steps; nothing later is measured
    accum = int(cfg.get("grad_accum") or 1)
    # a functional collective (FSDP2 clipping's norm) issues its c10d op on the fake group
    # (zeroexp._lib.fake_collectives)
    with (fake_tensor_mode() if fake else nullcontext()) as mode, IssueFunctionalCollectives(), \
            (lazy_fsdp2_chunks() if fake else nullcontext()), (allocated_by_size() if fake else nullcontext()), \
            _rank_of(n):
        pl.seed_everything(int(cfg.seed), workers=False, verbose=False)
        module = CellModule(build_model(cfg.model), cfg.model.loss, adapter.make_optimizer, adapter.clip_gradients,
                            log_loss=False)
        probes = [as_callback(cls)(ctx) for cls in classes]
        data = SyntheticBatches(OmegaConf.to_container(cfg.model, resolve=True), int(cfg.batch_size), int(cfg.seed),
                                0, steps * accum)
        data = FakeBatches(data, mode) if fake else DataLoader(data, batch_size=None)  # as a real rank's
        fit_cell(ctx, module, data, probes, steps=steps, num_nodes=n)  # one process, playing one node of n
    results = {probe.name: probe.rank_result() for probe in probes}
    return results["state"], results["collectives"], results.get("memory"), steps


class FakeBatches:
    """The micro-batches rank 0 of a real run trains on (``batches``, a dataset), each made real, then faked in
    ``mode``: an iterable, not a ``DataLoader`` (which seeds itself with a tensor read, impossible on fake tensors)."""

    def __init__(self, batches: Any, mode: Any) -> None:
        self.batches, self.mode = batches, mode

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self.batches)):
            with real_tensors():
                batch = self.batches[i]
            fake = self.mode.from_tensor(batch)
            del batch  # not kept alive by this generator while the step runs
            yield fake


@contextmanager
def _rank_of(world_size: int) -> Iterator[None]:
    """The process's environment as rank 0 of ``world_size`` (what Lightning's cluster environment reads, as in a
    real run), restored after."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                      NODE_RANK="0")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _simulates_memory(cfg: DictConfig) -> bool:
    """Whether a traced dry run of ``cfg`` runs the memory probe: one micro-batch a step (MemTracker refuses a
    second forward in one tracked step, as in a real run)."""
    return int(cfg.get("grad_accum") or 1) == 1


def _steps_read(schedule: Any, classes: list[Any]) -> int:
    """One past the last step that ``classes`` read (``Probe.steps`` on ``schedule``), at least warm-up."""
    ends = [schedule.warmup]
    for cls in classes:
        if cls.steps is not None:
            window = getattr(schedule, cls.steps.window)
            ends.append(window.stop if isinstance(window, range) else window + 1)
    return max(ends)


def _derived(cfg: DictConfig, ctx: RunContext
             ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any] | None, int]:
    """The model's structure on the meta device: the groups the cell's row derives from its shapes (what the
    adapter reads off its live structure in a real run), turned into collectives and a state table by the one
    expectation model (zeroexp.formulas)."""
    from zeroexp.formulas import rank_state_bytes, step_collectives
    from zeroexp.plan.check.cell import cell_groups
    from zeroexp.probes.collectives import SOURCE

    n, offload, expect = ctx.world_size, str(cfg.offload.name), ctx.expect
    layout, itemsize, knobs = expect.layout, expect.itemsize, expect.knobs
    groups = expect.groups = cell_groups(cfg)
    p_bytes = 4 * (groups.numel + sum(groups.frozen))  # P: every parameter, frozen ones included
    how = (f"zeroexp.formulas.step_collectives over the groups the row {expect.name} ({layout.label}) derives from "
           "the model's shapes")
    expected = step_collectives(layout, groups, itemsize, knobs)
    limits = layout.payload_limits(groups, knobs, expect.precision, offload) if layout.payload_limits else []
    if limits:  # the payload model is not exact for this cell: say so where the figures are shown
        how += "; not exact here: " + "; ".join(limits)
    dtype = str(cfg.precision.param_dtype)
    steps = list(ctx.schedule.profiled)
    records = [{"phase": "step", "step": s, "op": op, "dtype": dtype, "count": e["count"],
                "payload_bytes": e["payload_bytes"]} for s in steps for op, e in expected.items()]
    collectives = {"records": records, "steps": steps, "expected": expected, "expected_error": None,
                   "param_bytes": p_bytes, "source": f"derived, not traced: {how}", "derived_from": SOURCE}
    table = rank_state_bytes(layout, groups, itemsize, knobs, offload)
    compute = {"param", "grad"}  # in the compute dtype; masters, moments and step scalars in fp32
    state = [{"rows": [{"kind": k, "logical_bytes": v[r][0], "physical_bytes": v[r][1],
                        "dtype": dtype if k in compute else "float32", "device": "",
                        "numel": v[r][0] // (itemsize if k in compute else 4)} for k, v in table.items()],
              "step": ctx.schedule.state_step, "logical_param_bytes": p_bytes,
              "expected": expect.state_factors(groups.numel / max(groups.numel + sum(groups.frozen), 1)),
              "semantics": ctx.adapter.semantics} for r in range(n)]
    return state, collectives, None, 0


def _state_section(state: Any, cfg: DictConfig, source: str) -> tuple[dict[str, Any], Any]:
    """The state probe's section: over every rank (derived), or rank 0's bytes times N (traced)."""
    if source == "derived":
        report = StateProbe.aggregate(state, cfg)
        return {**report.section, "ranks_in_table": "every rank (formulas)"}, report.tables["rank_state.csv"]
    report = StateProbe.aggregate([state], cfg)
    s, n, p = report.section, int(cfg.world_size), int(state["logical_param_bytes"])
    frame = report.tables["rank_state.csv"]
    logical = {k: n * int(frame[frame.kind == k].logical_bytes.sum()) for k in s["factors"]}
    physical = {k: n * int(frame[frame.kind == k].physical_bytes.sum()) for k in s["factors"]}
    reasons = check_factors({k: v / p for k, v in logical.items()}, _rank0_factors(cfg, s["expected"], n, p),
                            logical, p, n, basis=f"= rank 0 x {n}",
                            note=" (rank 0's bytes by the formulas x N: see factors_basis)")
    s.update(factors={k: v / p for k, v in logical.items()}, physical_factors={k: v / p for k, v in physical.items()},
             padding_bytes=physical.get("param", 0) - logical.get("param", 0),
             padding_bytes_by_kind={k: physical[k] - logical[k] for k in logical},
             physical_param_bytes=physical.get("param", 0), optim_scalar_bytes=physical.get("optim_scalar", 0),
             owner_imbalance=None, check="FAIL" if reasons else "PASS", reasons=reasons,
             factors_basis=FACTORS_BASIS, ranks_in_table="rank 0")
    return s, frame


def _rank0_factors(cfg: DictConfig, expected: dict[str, float], n: int, p: int) -> dict[str, float]:
    """The factors rank 0's bytes x N give by the formulas (``zeroexp.plan.check.cell.rank_state_of``): the strategy's
    ``expected`` where every rank holds as much as rank 0, above them by the padding the last ranks hold instead of
    parameters otherwise; ``expected`` itself for a kind, precision or offload the formulas do not model."""
    from zeroexp.plan.check.cell import rank_state_of

    table = rank_state_of(cfg)
    if table is None:
        return expected
    return {k: n * table[k][0][0] / p if k in table else v for k, v in expected.items()}


def _finalize(cell: Path, cfg: DictConfig, run_info: dict[str, Any], source: str, state: Any,
              collectives: dict[str, Any], steps: int, live_groups: dict[str, Any] | None,
              memory: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``rank_state.csv``, ``collectives.csv``, ``memory.csv`` (simulated) and ``summary.json`` (with the
    planner's prediction)."""
    n = int(cfg.world_size)
    state_section, state_frame = _state_section(state, cfg, source)
    coll = CollectivesProbe.aggregate([collectives], cfg)
    coll_section = dict(coll.section)
    if source == "derived":  # measured == expected by construction: there is nothing to check
        coll_section.update(source=collectives["source"], check="n/a",
                            reasons=["derived from the model's structure, not traced: nothing measured to check"])
    coll_section["ranks_in_table"] = "rank 0"
    tables = {"rank_state.csv": state_frame, "collectives.csv": coll.tables["collectives.csv"]}
    absent = absent_in_dry_run(cfg)
    memory_section = None
    if memory and memory.get("records"):
        mem = MemoryProbe.aggregate([memory], cfg)
        memory_section = {**mem.section, "source": SIMULATED, "simulated": True}
        tables["memory.csv"] = mem.tables["memory.csv"]
        absent.pop(MemoryProbe.name, None)
    summary = summary_head(run_info, n, steps, mode="dry_run",
                           dry_run={"source": SOURCES[source], "played_rank": 0, "world_size": n, "backend": "fake",
                                    "steps_run": steps, "absent": absent,
                                    "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
                           state=state_section, collectives=coll_section)
    if memory_section is not None:
        summary["memory"] = memory_section
    itself = None if source == "traced" else ("a derived dry run's state and collectives are the planner's own "
                                              "model of this cell: comparing them with the plan cannot fail")
    write_summary(cell, cfg, summary, tables, live_groups=live_groups, itself=itself)
    if cfg.logger.name == "wandb":
        from zeroexp.rank.wandb_log import log_summary, make_logger

        log_summary(make_logger(cfg, cell, run_info), summary, cell)
    return summary
