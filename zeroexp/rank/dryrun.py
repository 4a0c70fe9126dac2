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
from zeroexp.probes import ProbeReport, RunContext, absent_in_dry_run, as_callback, probes_for
from zeroexp.probes.memory import freeze_startup_objects
from zeroexp.results.files import write_text
from zeroexp.cell.memo import invocation_memo
from zeroexp.cell.resolved import Cell
from zeroexp.rank.summary import summary_head, write_measured
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
CPU = torch.device("cpu")


def run_dry(cfg_dict: dict[str, Any], cell: Path, run_info: dict[str, Any], resolved: Cell | None = None
            ) -> dict[str, Any]:
    """Play rank 0 of the cell under a fake process group; write its tables and measured summary; return it.
    ``resolved``: the cell validation resolved (None: resolved here)."""
    warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
    cfg = OmegaConf.create(cfg_dict)
    resolved = resolved or Cell.of(cfg)
    n = resolved.world_size
    dist.init_process_group("fake", rank=0, world_size=n)  # no store: torch makes the fake backend's own
    with invocation_memo():
        try:
            adapter = get_adapter_class(cfg.strategy.name)(resolved.policy)
            ctx = RunContext(cfg=cfg, rank=0, world_size=n, device=CPU, adapter=adapter, schedule=resolved.schedule,
                             expect=Expectation(resolved, adapter.live_groups), cell=resolved)
            source = "traced" if adapter.dry_run_traced else "derived"
            results, steps = (_traced if source == "traced" else _derived)(cfg, ctx)
            write_text(Path(cell) / ".ranks" / "rank0.json", json.dumps(results))
            return _finalize(Path(cell), cfg, run_info, source, results, steps, ctx.expect.groups_record(),
                             resolved)
        finally:
            dist.destroy_process_group()


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
    cell = Cell.of(cfg)
    n = cell.world_size
    dist.init_process_group("fake", rank=0, world_size=n)
    try:
        adapter = get_adapter_class(cfg.strategy.name)(cell.policy)
        if not adapter.dry_run_traced:
            raise ValueError(f"strategy={cfg.strategy.name} is not traced under the fake process group "
                             "(StrategyAdapter.dry_run_traced)")
        ctx = RunContext(cfg=cfg, rank=0, world_size=n, device=device, adapter=adapter,
                         schedule=cell.schedule, expect=Expectation(cell, adapter.live_groups), cell=cell)
        results, steps = _traced(cfg, ctx, fake=False)
    finally:
        dist.destroy_process_group()
    memory = results.get("memory")
    section = {**_probe(cell, "memory").aggregate([memory], cell).section, "backend": "fake"} if memory else None
    return {**results, "memory": memory, "memory_section": section, "steps": steps}


def _traced(cfg: DictConfig, ctx: RunContext, fake: bool = True) -> tuple[dict[str, Any], int]:
    """Rank 0's steps under FakeTensorMode (``fake``; else real tensors on ``ctx.device``: :func:`play_rank0`),
    trained by the real run's loop (zeroexp.rank.fit: Lightning's Trainer and the adapter's strategy) with the real
    run's state and collectives probes, and the memory probe (its figures simulated under FakeTensorMode: see
    :data:`zeroexp.probes.memory.SIMULATED`) where the cell runs it."""
    import lightning.pytorch as pl

    from zeroexp.rank.fit import fit_cell

    adapter, schedule, n = ctx.adapter, ctx.schedule, ctx.world_size
    adapter.setup(ctx.device)  # e.g. FSDP2's device mesh: real tensors, made before FakeTensorMode
    classes = [cls for cls in probes_for(ctx.cell) if cls.in_dry_run(ctx.cell)]  # each probe says whether it runs
    steps = _steps_read(schedule, classes)  # warm-up and those probes' steps; nothing later is measured
    accum = ctx.cell.grad_accum
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
    return {probe.name: probe.rank_result() for probe in probes}, steps


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


def _steps_read(schedule: Any, classes: list[Any]) -> int:
    """One past the last step that ``classes`` read (``Probe.steps`` on ``schedule``), at least warm-up."""
    ends = [schedule.warmup]
    for cls in classes:
        if cls.steps is not None:
            window = getattr(schedule, cls.steps.window)
            ends.append(window.stop if isinstance(window, range) else window + 1)
    return max(ends)


def _derived(cfg: DictConfig, ctx: RunContext) -> tuple[dict[str, Any], int]:
    """The model's structure on the meta device: the groups the cell's row derives from its shapes (what the
    adapter reads off its live structure in a real run), and each probe's records derived from them by the one
    expectation model (``Probe.derived``: every rank's)."""
    from zeroexp.plan.check.cell import cell_groups

    groups = ctx.expect.groups = cell_groups(ctx.cell)
    records = {cls.name: cls.derived(ctx, groups) for cls in probes_for(ctx.cell)}
    return {name: r for name, r in records.items() if r is not None}, 0


def _probe(cell: Cell, name: str) -> Any:
    """The probe class of this cell named ``name``."""
    return next(cls for cls in probes_for(cell) if cls.name == name)


def _finalize(cell: Path, cfg: DictConfig, run_info: dict[str, Any], source: str, results: dict[str, Any],
              steps: int, live_groups: dict[str, Any] | None, resolved: Cell | None = None) -> dict[str, Any]:
    """Each probe's section and tables from the played rank's results (traced) or its derived records
    (``Probe.dry_report``), every other probe absent with its reason: the measured summary, to which the launching
    process adds the planner's prediction (zeroexp.launch.epilogue). A probe with neither a section nor a reason is
    an error: no result is dropped silently."""
    n, sections, tables, absent = int(cfg.world_size), {}, {}, {}
    for cls in probes_for(resolved):
        found = results.get(cls.name)
        rows = found if source == "derived" else [found]
        report: ProbeReport | None = cls.dry_report(rows, resolved, source) if found is not None else None
        if report is None:
            if not cls.dry_run_absent:
                raise RuntimeError(f"probe {cls.name!r} gave no dry-run section and no reason (Probe.dry_run_absent)")
            absent[cls.name] = cls.dry_run_absent
            continue
        sections[cls.name] = report.section
        tables.update(report.tables)
    summary = summary_head(run_info, n, steps, mode="dry_run",
                           dry_run={"source": SOURCES[source], "played_rank": 0, "world_size": n, "backend": "fake",
                                    "steps_run": steps, "absent": absent,
                                    "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
                           **sections)
    itself = None if source == "traced" else ("a derived dry run's state and collectives are the planner's own "
                                              "model of this cell: comparing them with the plan cannot fail")
    return write_measured(cell, summary, tables, live_groups=live_groups, itself=itself)
