#!/usr/bin/env bash
# One node's share of a zeroexp cell run by torchrun (c10d rendezvous, any number of nodes): run it on every
# node with the same NNODES, RDZV_ENDPOINT (host:port on one of the nodes) and RDZV_ID; overrides follow.
# zeroexp reads rank and world size from torchrun's environment; every rank writes the same cell directory
# (outputs/runs/torchrun-<RDZV_ID>_<cell name>/), which must be on a file system all nodes see.
#   NNODES=2 NPROC_PER_NODE=4 RDZV_ENDPOINT=node0:29400 RDZV_ID=exp1 launchers/torchrun.sh strategy=fsdp_full
# One machine as two nodes (tests/test_cluster.py): run it twice, with LOCAL_ADDR=127.0.0.1 and
# RDZV_ENDPOINT=127.0.0.1:29400 (NODE_RANK=0 / 1 are optional: the c10d rendezvous numbers nodes itself).
set -euo pipefail
: "${NNODES:=1}" "${NPROC_PER_NODE:=4}" "${RDZV_ENDPOINT:=127.0.0.1:29400}" "${RDZV_ID:=zeroexp}"
args=(--nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" --rdzv-backend=c10d
      --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID")
if [[ -n "${NODE_RANK:-}" ]]; then args+=(--node-rank="$NODE_RANK"); fi
if [[ -n "${LOCAL_ADDR:-}" ]]; then args+=(--local-addr="$LOCAL_ADDR"); fi
exec torchrun "${args[@]}" -m zeroexp launcher=torchrun "$@"
