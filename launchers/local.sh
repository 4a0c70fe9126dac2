#!/usr/bin/env bash
# Run one zeroexp cell, or a sweep, on this machine: zeroexp starts the world_size rank processes itself
# (gloo on CPU, NCCL with one GPU per rank when enough GPUs are visible).
#   launchers/local.sh strategy=fsdp_full prefetch=post world_size=4
#   launchers/local.sh --multirun experiment=zero_ladder
set -euo pipefail
exec python -m zeroexp "$@"
