"""The divergence replay of a cell (zeroexp.probes.divergence): after the measured steps, when the equivalence check
FAILed above its bound (or ``probes.trace_divergence=true``), every rank trains the cell again from the same seed on
the same batches, any injected fault re-applied, under a freshly wrapped model and its own Lightning trainer, with the
tracer as its only callback; rank 0 compares each step with the references and returns where training parted.
Nothing of it is measured: every probe's window closed before it starts."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from zeroexp.errors import one_line
from zeroexp.models import build_model
from zeroexp.models.module import CellModule, SyntheticBatches
from zeroexp.probes import as_callback
from zeroexp.probes.divergence import DivergenceTracer, Watch, replay_wanted
from zeroexp.probes.equivalence import UNGRADED
from zeroexp.rank.fit import fit_cell
from zeroexp.rank.summary import MEASURED, RANKS_DIR
from zeroexp.results.files import read_json, write_json
from zeroexp.strategies import get_adapter_class
from zeroexp.tolerances import THRESHOLDS

__all__ = ["locate_divergence"]


def locate_divergence(ctx: Any, cfg_dict: Mapping[str, Any], run_info: Mapping[str, Any],
                      equivalence: Mapping[str, Any] | None, *, cell: Path, devices: int, num_nodes: int,
                      backend: str) -> None:
    """On every rank, once the measured summary is written: replay the cell when rank 0's ``equivalence`` section asks
    for it (:func:`replay_wanted`); rank 0 adds what it found to that summary's equivalence section
    (``.ranks/measured.json``: ``divergence``). A replay that raises on every rank alike (a rank 0 that cannot build its
    references stops the tracer's gathering on every rank from the first step) is said in ``divergence.error``; the
    measured summary is never lost to it."""
    cfg = ctx.cfg
    wanted = [replay_wanted(cfg.probes.get("trace_divergence"), equivalence) if ctx.rank == 0 else None]
    dist.broadcast_object_list(wanted, src=0, device=ctx.device if ctx.device.type == "cuda" else None)
    if not wanted[0]:
        return
    try:
        found = _replay(ctx, cfg_dict, run_info, root=cell / RANKS_DIR / "replay", devices=devices,
                        num_nodes=num_nodes, backend=backend)
    except Exception as e:  # noqa: BLE001 - the explanation failed, not the cell: said where the parting would be
        found = {"found": False, "error": f"{type(e).__name__}: {one_line(str(e), 500)}",
                 "why": "the replay raised: no divergence located"}
    if ctx.rank == 0:
        measured = read_json(cell / RANKS_DIR / MEASURED)
        section = measured["summary"].get("equivalence")
        if isinstance(section, dict):
            section["divergence"] = found
            write_json(cell / RANKS_DIR / MEASURED, measured)


def _replay(ctx: Any, cfg_dict: Mapping[str, Any], run_info: Mapping[str, Any], *, root: Path, devices: int,
            num_nodes: int, backend: str) -> dict[str, Any]:
    cfg, resolved = ctx.cfg, ctx.cell
    adapter = get_adapter_class(cfg.strategy.name)(resolved.policy)
    replayed = replace(ctx, adapter=adapter)
    watch, failed = None, None
    if ctx.rank == 0:  # the references; where they cannot be built the tracer gathers nothing, on every rank
        try:
            source = resolved.load_from
            start = None if source is None else (source, adapter.read_whole(source.kind, Path(source.dir)))
            flat = ctx.expect.layout.family.flat_buffers if ctx.expect is not None else False
            watch = Watch(cfg, clip=adapter.clip_grad_norm, threshold=THRESHOLDS.get(cfg.precision.name),
                          start=start, ungraded_why=UNGRADED if flat else None)
        except Exception as e:  # noqa: BLE001 - said in the result, the other ranks stop with rank 0
            failed = f"{type(e).__name__}: {one_line(str(e), 500)}"
    pl.seed_everything(cfg.seed, workers=False, verbose=False)  # the measured run's initial weights
    with torch.device("meta") if resolved.init == "meta" else nullcontext():
        net = build_model(cfg.model)
    module = CellModule(net, cfg.model.loss, adapter.make_optimizer, adapter.clip_gradients, log_loss=False)
    accum = resolved.grad_accum
    data = DataLoader(SyntheticBatches(cfg_dict["model"], cfg.batch_size, cfg.seed, ctx.rank, cfg.steps * accum,
                                       start=resolved.first_step * accum), batch_size=None)
    callbacks: list[Any] = []
    fault = run_info.get("fault")
    if fault:
        from zeroexp.rank.faults import REPLAYED, Fault, fault_injector

        parsed = Fault.parse(fault)
        if parsed.kind in REPLAYED:  # before the tracer: a fault at the step's end has acted when it gathers
            callbacks.append(fault_injector(parsed, ctx.rank, run_info["cell_name"]))
    tracer = as_callback(DivergenceTracer)(replayed, watch, failed)
    fit_cell(replayed, module, data, [*callbacks, tracer], steps=int(cfg.steps), logger=False, root=str(root),
             devices=devices, num_nodes=num_nodes, backend=backend)
    return tracer.rank_result()
