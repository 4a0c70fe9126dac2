"""Launching a cell (runs in the launching process): one cell's manifest, launch and outcome (:mod:`.runner`), the
local launcher and its forkserver (:mod:`.local`, preloading :mod:`.wandb_preload` and :mod:`.rank_preload`), ranks
that torchrun or SLURM started (:mod:`.cluster`, the one part that runs in a rank), and the progress watcher
(:mod:`.progress`). The forkserver imports modules under here by name, so this file imports nothing."""
