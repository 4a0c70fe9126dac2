#!/usr/bin/env bash
# One GPU check, ends inside 10 minutes: (1) tests/test_cuda.py's GPU cells (DDP and ZeRO at N=1; NCCL at N=2, FSDP
# CPUOffload and DeepSpeed fp16 with two or more GPUs); (2) one rank of N=4 and N=8 played on one GPU under torch's
# fake process group with real CUDA tensors (benchmarks/gpu_check.py), planned beside measured in one JSON
# (${OUT:-.}/gpu_check.json). Without a GPU it skips with the reason and exits 0; the CPU side of both runs in
# tests/test_cuda.py on any machine. Record the JSON's figures in docs/benchmarks.md. GPU_CHECK=llama runs the
# ~1.1 B Llama's check instead (below), its own call of at most 9 minutes.
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
if [ "${GPU_CHECK:-cells}" = llama ]; then
    # GPU_CHECK=llama: a ~1.1 B Llama (conf/model/llama_1b.yaml) at N=1, bf16, full and selective_op checkpointing,
    # real cells planned beside measured (benchmarks/gpu_llama.py: allocated, reserved, NVML-used, phase times), then
    # one rank of FSDP2 at N=8 under the fake process group: at most 9 minutes
    timeout 300 "$PY" benchmarks/gpu_llama.py --out "$out/gpu_llama.json" || rc=$?
    timeout 240 "$PY" benchmarks/gpu_check.py --device cuda --model llama_1b --world-sizes 8 --batch-size 4 \
        --strategies fsdp2_full --set precision=bf16 --set activation_checkpointing=full \
        --out "$out/gpu_check_llama.json" || rc=$?
    echo "gpu_check (llama): exit $rc; JSON at $out/gpu_llama.json and $out/gpu_check_llama.json"
    exit $rc
fi
# (1) the GPU cells: at most 5 minutes
timeout 300 "$PY" -m pytest -q -rs -m gpu tests/test_cuda.py || rc=$?
# (2) one rank of N on one GPU, every traced FSDP strategy, N=4 and 8 (each cell its own process): at most 4 minutes
timeout 240 "$PY" benchmarks/gpu_check.py --device cuda --model seed_ch31 --world-sizes 4,8 --batch-size 8 \
    --out "$out/gpu_check.json" || rc=$?
echo "gpu_check: exit $rc; JSON at $out/gpu_check.json"
exit $rc
