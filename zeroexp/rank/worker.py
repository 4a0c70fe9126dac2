"""One rank of a cell: build the model, the adapter's Lightning strategy and the probes, train, report.

:func:`run_rank` is the same whoever started the process (zeroexp's local launcher, or later torchrun):
it reads its rank from the environment, trains, writes ``.ranks/rank<r>.json``, and rank 0 assembles the
cell's files once every rank has written its own.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from zeroexp.rank.deathsig import die_with_parent
from zeroexp.devices import pin_host_allocator, rank_threads, ranks_get_a_gpu
from zeroexp.errors import one_line
from zeroexp.plan.check.expect import Expectation
from zeroexp.models import build_model
from zeroexp.cell.memo import invocation_memo
from zeroexp.cell.resolved import Cell
from zeroexp.models.module import CellModule, SyntheticBatches
from zeroexp.probes import RunContext, as_callback, probes_for
from zeroexp.probes.init_peak import InitPeak, init_fields
from zeroexp.probes.memory import freeze_startup_objects
from zeroexp.results.files import write_json, write_text
from zeroexp.results.verdict import Check, Code, Reason, Verdict
from zeroexp.strategies import get_adapter_class
from zeroexp.rank.fit import fit_cell, make_logger
from zeroexp.rank.summary import RANKS_DIR, summary_head, write_measured

#: The key of a rank's init-peak record in its ``.ranks/rank<r>.json`` (zeroexp.probes.init_peak).
INIT_RECORD = "init_peak"
#: In a local rank's ``environ``: the pid of the launching (main) process (zeroexp.launch.local), watched at start-up.
LAUNCHER_PID_ENV = "ZEROEXP_LAUNCHER_PID"


def rank_entry(rank: int, world_size: int, port: int, cfg: dict[str, Any], cell_dir: str, run_info: dict,
               environ: dict[str, str], cell: Cell | None = None) -> None:
    """Process target of the local launcher: set up the rank's environment and logs, then :func:`run_rank`.

    ``environ`` is the launching process's environment: ranks are forked from a forkserver started earlier,
    whose environment may be older. ``cell``: the cell validation resolved (zeroexp.cell.resolved).
    """
    _die_with_parent(int(environ.get(LAUNCHER_PID_ENV, 0)) or None)
    os.environ.update(environ)
    where = Path(cell_dir)
    with rank_log(where / "logs" / f"rank{rank}.log"):
        _run_local_rank(rank, world_size, port, cfg, where, run_info, cell)


def _run_local_rank(rank: int, world_size: int, port: int, cfg: dict[str, Any], cell_dir: Path, run_info: dict,
                    cell: Cell | None) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0", GROUP_RANK="0",
    )
    # The launcher serves the rendezvous store on 127.0.0.1 (zeroexp.launch.local.loopback_store): every rank is its
    # client.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    # One machine: keep gloo's and NCCL's own sockets on loopback too.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    try:
        if cfg["dry_run"]:  # one process plays rank 0 of world_size under a fake process group
            from zeroexp.rank.dryrun import run_dry

            run_dry(cfg, cell_dir, run_info, cell)
        else:
            run_rank(cfg, cell_dir, run_info, cell)
    except BaseException as e:  # noqa: BLE001 - every failure is recorded, then re-raised as exit code 1
        traceback.print_exc()
        write_json(cell_dir / RANKS_DIR / f"rank{rank}.error.json",
                   {"rank": rank, "cause": "exception", "type": type(e).__name__, "message": one_line(str(e), 2000),
                    "time": time.time(),
                    "traceback": traceback.format_exc()[-8000:]})
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush(), sys.stderr.flush()


@contextmanager
def rank_log(path: Path) -> Iterator[None]:
    """This process's stdout and stderr (file descriptors 1 and 2, so C++ and child output too) appended to
    ``path``, restored on exit; the local launcher and torchrun / SLURM ranks share it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1), os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def _die_with_parent(launcher_pid: int | None = None) -> None:
    """No rank outlives its launcher, even one killed outright (SIGKILL, the OOM killer).

    A local rank's parent is the forkserver, not the launching process: this rank gets SIGKILL when the forkserver
    dies (PR_SET_PDEATHSIG), and the forkserver gets SIGKILL when the launcher dies (zeroexp.rank.deathsig, its first
    preload). Its own way out stays open too: the forkserver exits when it reads EOF on its "alive" pipe, whose
    write end the launcher holds, but every forked child inherits that write end
    (``multiprocessing.forkserver._forkserver._forkserver_alive_fd``), so while any rank lived it never saw its
    launcher go: closed here. If the launcher (``launcher_pid``) is already gone (it died while this rank was being
    forked, before the death signal was armed), exit now."""
    die_with_parent()  # zeroexp.rank.deathsig: the forkserver, in turn, dies with the launcher
    try:
        from multiprocessing import forkserver

        fd = forkserver._forkserver._forkserver_alive_fd
        if fd is not None:
            os.close(fd)
            forkserver._forkserver._forkserver_alive_fd = None  # this rank starts no forkserver children
    except (ImportError, AttributeError, OSError):
        pass
    if launcher_pid is not None:
        try:
            os.kill(launcher_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:
            pass


def _quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*Checkpointing is disabled.*")
    warnings.filterwarnings("ignore", message=".*FSDP.state_dict_type.*")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")


def resolve_device(cfg: Any) -> torch.device:
    """``device=auto``: CUDA when enough GPUs are visible for one per rank of this node, else the CPU."""
    return torch.device("cuda" if ranks_get_a_gpu(cfg) else "cpu")  # zeroexp.devices: the one rule


def run_rank(cfg_dict: dict[str, Any], cell_dir: Path, run_info: dict, resolved: Cell | None = None) -> None:
    """Train one rank of the cell and write its results; rank 0 also writes the cell's files. ``resolved``: the cell
    validation resolved (the local launcher's); None: resolved here (a torchrun or SLURM rank, which validated)."""
    _quiet()
    from zeroexp.devices import ALLOC_CONF_ENV, cuda_alloc_conf

    conf = cuda_alloc_conf(bool((cfg_dict.get("allocator") or {}).get("expandable_segments")),
                           os.environ.get(ALLOC_CONF_ENV))
    if conf is not None:  # before the rank's first CUDA allocation, which reads it
        os.environ[ALLOC_CONF_ENV] = conf
    freeze_startup_objects()  # the memory probe's cycle collections walk only what this rank creates from here
    cfg = OmegaConf.create(cfg_dict)
    with invocation_memo():
        _train(cfg, cfg_dict, cell_dir, run_info, resolved or Cell.of(cfg))


def _train(cfg: Any, cfg_dict: dict[str, Any], cell: Path, run_info: dict, resolved: Cell) -> None:
    # The rank's place: what its process group is made of (the launcher's, torchrun's or SLURM's environment), the one
    # source in the rank (RunContext, the adapters through torch.distributed); zeroexp.launch.cluster.rank refuses a
    # cell whose world_size is not it.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = resolve_device(cfg)
    pin_host_allocator()  # zeroexp.devices: the same C allocator settings as a calibration's ranks
    if device.type == "cpu":  # ranks share the cores: do not oversubscribe them
        torch.set_num_threads(rank_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    adapter = get_adapter_class(cfg.strategy.name)(resolved.policy)
    ctx = RunContext(cfg=cfg, rank=rank, world_size=world_size,
                     device=torch.device("cuda", int(os.environ["LOCAL_RANK"])) if device.type == "cuda" else device,
                     adapter=adapter, schedule=resolved.schedule, expect=Expectation(resolved, adapter.live_groups),
                     cell=resolved)

    pl.seed_everything(cfg.seed, workers=False, verbose=False)  # identical initial weights on every rank
    init_peak = InitPeak(ctx.device)  # measured from here to on_fit_start: the model built and wrapped
    init_peak.begin()
    with torch.device("meta") if resolved.init == "meta" else nullcontext():  # init=meta: the adapter materialises it
        net = build_model(cfg.model)
    module = CellModule(net, cfg.model.loss, adapter.make_optimizer, adapter.clip_gradients,
                        log_loss=resolved.logs_loss)
    accum = resolved.grad_accum  # micro-batches per optimizer step (zeroexp.rank.microbatches)
    data = DataLoader(SyntheticBatches(cfg_dict["model"], cfg.batch_size, cfg.seed, rank, cfg.steps * accum,
                                       start=resolved.first_step * accum), batch_size=None)
    probe_classes = probes_for(resolved)
    probes = [as_callback(cls)(ctx) for cls in probe_classes]  # each a Lightning callback
    callbacks: list[pl.Callback] = list(probes)
    if run_info.get("fault"):
        from zeroexp.rank.faults import Fault, fault_injector

        callbacks.append(fault_injector(Fault.parse(run_info["fault"]), rank, run_info["cell_name"]))
    if rank == 0:  # rank 0's progress in .progress.json, shown live by the launching process (zeroexp.launch.progress)
        callbacks.append(_Progress(cell, int(cfg.steps)))
    logger = make_logger(cfg, cell) if rank == 0 else False

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    fit_cell(ctx, module, data, callbacks, per_batch=[init_peak], steps=int(cfg.steps), logger=logger,
             root=str(cell), devices=local, num_nodes=world_size // local,
             backend="nccl" if device.type == "cuda" else "gloo")

    results = {p.name: p.rank_result() for p in probes}
    results[INIT_RECORD] = init_peak.record
    write_text(cell / RANKS_DIR / f"rank{rank}.json", json.dumps(results))
    dist.barrier()  # outside every measured window: all rank files exist
    if rank == 0:  # the plan is the launching process's, once every rank is done (zeroexp.launch.epilogue)
        finalize(cell, cfg, probe_classes, run_info, live_groups=ctx.expect.groups_record(), resolved=resolved)
    del module, net, data  # the measured model: the replay builds its own
    import gc

    gc.collect()
    from zeroexp.rank.replay import locate_divergence  # after the measured summary: where training parted

    locate_divergence(ctx, cfg_dict, run_info, results.get("equivalence"), cell=cell, devices=local,
                      num_nodes=world_size // local, backend="nccl" if device.type == "cuda" else "gloo")
    dist.barrier()
    dist.destroy_process_group()


class _Progress(pl.Callback):
    """After each step (after the probes' hooks, outside their windows): rank 0's step, loss and times."""

    def __init__(self, cell: Path, steps: int) -> None:
        from zeroexp.rank.progress import StepRecorder

        self.recorder = StepRecorder(cell, steps)

    def on_train_start(self, trainer, pl_module) -> None:
        self.recorder.t0 = self.recorder._last_step_end = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        try:
            self.recorder.step(batch_idx + 1, float(loss.detach().float().item()) if loss is not None else None)
        except OSError:  # progress is a courtesy: never fail a cell for it
            pass


def finalize(cell: Path, cfg: Any, probe_classes: list, run_info: dict,
             live_groups: dict[str, Any] | None = None, resolved: Cell | None = None) -> dict[str, Any]:
    """Read every rank's results, write the probes' tables and the measured summary (``.ranks/measured.json``,
    zeroexp.rank.summary); return the summary.
    ``live_groups``: rank 0's groups as its adapter read them (compared with the planner's in ``plan``); ``resolved``:
    the cell (default: resolved from ``cfg``)."""
    resolved = resolved or Cell.of(cfg)
    world_size = int(cfg.world_size)
    ranks = [json.loads((cell / RANKS_DIR / f"rank{r}.json").read_text()) for r in range(world_size)]
    summary = summary_head(run_info, world_size, int(cfg.steps), final_loss=None)
    tables: dict[str, Any] = {}
    skipped = resolved.schedule.skipped  # windows that did not fit in `steps`: those probes read n/a
    for cls in probe_classes:
        window = cls.steps.window if cls.steps is not None else None
        if window in skipped:
            said = Check(Verdict.NA, (Reason(Code.TOO_FEW_STEPS, skipped[window]),))
            summary[cls.name] = {"check": said.verdict, "reason": skipped[window], **said.fields()}  # both keys
            summary.setdefault("skipped", {})[cls.name] = skipped[window]
            continue
        report = cls.aggregate([r[cls.name] for r in ranks], resolved)
        tables.update(report.tables)
        summary.update(report.top_level)
        if report.section:
            summary[cls.name] = report.section
    init = init_fields([r.get(INIT_RECORD) for r in ranks], resolved.init)  # measured: the build and wrap of the model
    if init and isinstance(summary.get("memory"), dict):
        summary["memory"].update(init)
    return write_measured(cell, summary, tables, live_groups=live_groups)

