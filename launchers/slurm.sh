#!/usr/bin/env bash
# zeroexp cells as SLURM jobs through Hydra's submitit launcher (pip install -e '.[cluster]'), from a login
# node: every job of the sweep is one SLURM job of NODES x RANKS_PER_NODE tasks, each task one rank, all
# writing the sweep's cell directory (on a file system every node sees).
#   NODES=2 RANKS_PER_NODE=4 GPUS_PER_NODE=4 PARTITION=gpu launchers/slurm.sh strategy=ddp,zro,fsdp_full
# Without SLURM, the same tasks on this machine: launchers/slurm.sh hydra/launcher=submitit_local ...
set -euo pipefail
: "${NODES:=1}" "${RANKS_PER_NODE:=4}"
args=(--multirun launcher=slurm world_size=$((NODES * RANKS_PER_NODE)) launcher.nodes="$NODES"
      launcher.ranks_per_node="$RANKS_PER_NODE")
if [[ -n "${PARTITION:-}" ]]; then args+=(hydra.launcher.partition="$PARTITION"); fi
if [[ -n "${GPUS_PER_NODE:-}" ]]; then args+=(hydra.launcher.gpus_per_node="$GPUS_PER_NODE"); fi
if [[ -n "${TIMEOUT_MIN:-}" ]]; then args+=(hydra.launcher.timeout_min="$TIMEOUT_MIN"); fi
exec python -m zeroexp "${args[@]}" "$@"
