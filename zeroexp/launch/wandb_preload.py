"""What the launching process of a ``logger=wandb`` cell (the default) imports before torch, for the cell's W&B run
(zeroexp.launch.wandb_cell; zeroexp.launch.runner.run_cell has validation import this once the config's keys
passed, before its model check imports torch).

``wandb.init`` imports W&B's launch inputs (``Run._detect_and_apply_job_inputs``), and with them ``wandb.apis.public``,
whose pydantic models read their fields' docstrings through ``inspect.getmodule``: a walk over every module in
``sys.modules`` per class. After torch, Lightning and DeepSpeed (~4,000 modules), that import took 1.4 to 2 s (py-spy of
a ddp cell's rank 0, 2 ranks, logger=wandb: 2.4 s of its 3.5 s over the same cell without W&B); before torch, 0.4 s
once per process. Where W&B is not installed or moves the module, the ImportError is ignored and the run's start
imports what it needs.
"""

import wandb  # noqa: F401
import wandb.sdk.launch.inputs.internal  # noqa: F401
