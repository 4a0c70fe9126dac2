#!/usr/bin/env bash
# On a GPU machine: the CUDA/NCCL cells of tests/test_cuda.py (every strategy at N=1 on one GPU; NCCL at N=2, FSDP
# CPUOffload and DeepSpeed fp16 with two or more). Results go to stdout; record them in docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv || true
python -m pytest -q -rs tests/test_cuda.py
