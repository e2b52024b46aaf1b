#!/usr/bin/env bash
# Prepared GPU check (under 5 minutes on one GPU): the NCCL/CUDA paths of hvdkit.
# Needs a CUDA build of torch and Horovod built with HOROVOD_GPU_OPERATIONS=NCCL.
# Writes everything under ${OUT:-gpu-results}.
set -euo pipefail
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
python -m hvdkit doctor | tee "$OUT/doctor.txt"
python - <<'PY' | tee "$OUT/cuda.txt"
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda)
print("nccl", torch.distributed.is_nccl_available())
PY
NP="$(python -c 'import torch; print(max(2, torch.cuda.device_count()))')"
# training on both backends (one rank per GPU; with one GPU the ranks share it)
python -m hvdkit run -np "$NP" --backend ddp --model cnn --epochs 2 --num-samples 4096 | tee "$OUT/ddp.txt"
python -m hvdkit run -np "$NP" --backend horovod --model cnn --epochs 2 --num-samples 4096 | tee "$OUT/horovod.txt"
# the benchmark suite in quick mode, GPU tensors throughout
python -m hvdkit bench --quick --np "$NP" --out "$OUT/bench" | tee "$OUT/bench.txt"
