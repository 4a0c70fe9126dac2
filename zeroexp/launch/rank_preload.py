"""The ranks' forkserver preload, after every adapter (``zeroexp.strategies._preload``; ``zeroexp.launch.local``): the
modules each rank of each cell imported by itself, then the objects of all imports frozen once, here.

Measured with cProfile in rank 0 of a small test cell (2 ranks, 8 x 64^2, 10 steps, the forkserver warm, a loaded
2-core host), of 3.3 s: 0.83 s in :func:`~zeroexp.probes.memory.freeze_startup_objects` (its scan of the ~600,000
objects of the imports for tensors), 0.49 s importing Hydra (``build_model``'s ``instantiate``), the memory probe's
trackers and rank 0's planner. Frozen here, the objects stay frozen in each forked rank (``gc.freeze`` is process
state that fork copies; the tensors among them stay weakly referenced in ``_FROZEN_TENSORS``), and the rank's own
:func:`~zeroexp.probes.memory.freeze_startup_objects` walks only what the fork added: the rank tracks the same
tensors as before and its cycle collections walk the same objects.
"""

import hydra.utils  # noqa: F401 - zeroexp.models.build_model: hydra.utils.instantiate
import zeroexp._lib.memtrack

zeroexp._lib.memtrack.import_mem_tracker()  # MemTracker's module: zeroexp._lib.memtrack, zeroexp.probes.init_peak

import zeroexp.plan.check.cell  # noqa: F401 - rank 0's finalize: the planner's prediction beside the measurement
import zeroexp.plan.check.memory  # noqa: F401
import zeroexp.plan.check.step_time  # noqa: F401

# What every rank of a cell still imported by itself, after the imports above (sys.modules at run_rank's end less
# the forkserver's, an FSDP2 cell's two ranks): the rank's entry (its module, unpickled by name), the Lightning
# strategy and its imports (Lightning's DDPStrategy.setup: DDP's comm hooks; autocast; the meta build's replay), rank
# 0's progress file, the last rank's step traces ahead (the planner's fake-tensor step)
# and rank 0's tables (pandas' CSV writer, its Arrow strings). About 25 ms a rank, quiet 2-core host.
import pandas.io.formats.csvs  # noqa: F401
import pyarrow.pandas_compat  # noqa: F401
import pyarrow.vendored.version  # noqa: F401
import torch.distributed.algorithms.ddp_comm_hooks  # noqa: F401
import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook  # noqa: F401
import zeroexp._lib.fake_tensors  # noqa: F401
import zeroexp._lib.fsdp2  # noqa: F401
import zeroexp._lib.trainer  # noqa: F401
import zeroexp.launch.local  # noqa: F401
import zeroexp.models.init  # noqa: F401
import zeroexp.plan.network  # noqa: F401
import zeroexp.plan.stack  # noqa: F401
import zeroexp.plan.steptrace  # noqa: F401
import zeroexp.rank.progress  # noqa: F401
import zeroexp.strategies._amp  # noqa: F401
import zeroexp.strategies._lightning  # noqa: F401
import zeroexp.strategies._meta_init  # noqa: F401
import warnings

from zeroexp.probes.memory import freeze_startup_objects

with warnings.catch_warnings():  # the scan touches deprecated module aliases (torch.distributed.reduce_op): the
    warnings.simplefilter("ignore")  # forkserver writes to the launching process's stderr, which stays clean
    freeze_startup_objects()  # last: every import above is frozen
