"""The ranks' forkserver preload before torch (``zeroexp.launch.local.FORKSERVER_PRELOAD``): what rank 0 of a
``logger=wandb`` cell (the default) imports when its W&B run starts, imported once for all ranks instead.

``wandb.init`` imports W&B's launch inputs (``Run._detect_and_apply_job_inputs``), and with them ``wandb.apis.public``,
whose pydantic models read their fields' docstrings through ``inspect.getmodule``: a walk over every module in
``sys.modules`` per class. In a rank, after torch, Lightning and DeepSpeed (~4,000 modules), that import took 1.4 to 2 s
of rank 0's start-up in every cell while its peers waited (py-spy of a ddp cell, 2 ranks, logger=wandb: 2.4 s of its
3.5 s over the same cell without W&B); here, before torch, 0.4 s once per forkserver. Where W&B is not installed or
moves the module, the forkserver skips this preload (it ignores an ImportError) and the rank imports what it needs.
"""

import wandb  # noqa: F401
import wandb.sdk.launch.inputs.internal  # noqa: F401
