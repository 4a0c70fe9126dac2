#!/usr/bin/env bash
# One GPU check, ends inside 10 minutes: (1) tests/test_cuda.py's GPU cells (DDP and ZeRO at N=1; NCCL at N=2, FSDP
# CPUOffload and DeepSpeed fp16 with two or more GPUs); (2) one rank of N=4 and N=8 played on one GPU under torch's
# fake process group with real CUDA tensors (benchmarks/gpu_check.py), planned beside measured in one JSON
# (${OUT:-.}/gpu_check.json). Without a GPU it skips with the reason and exits 0; the CPU side of both runs in
# tests/test_cuda.py on any machine. Record the JSON's figures in docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "SKIP: no CUDA device here (torch.cuda.is_available() is False): tests/test_cuda.py's GPU cells and the" \
         "one-rank-of-N check need one GPU"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv || true
out=${OUT:-.}
rc=0
# (1) the GPU cells: at most 5 minutes
timeout 300 "$PY" -m pytest -q -rs -m gpu tests/test_cuda.py || rc=$?
# (2) one rank of N on one GPU, every traced FSDP strategy, N=4 and 8 (each cell its own process): at most 4 minutes
timeout 240 "$PY" benchmarks/gpu_check.py --device cuda --model seed_ch31 --world-sizes 4,8 --batch-size 8 \
    --out "$out/gpu_check.json" || rc=$?
echo "gpu_check: exit $rc; JSON at $out/gpu_check.json"
exit $rc
