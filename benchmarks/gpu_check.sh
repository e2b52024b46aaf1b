#!/usr/bin/env bash
# Prepared GPU check (under 5 minutes): hvdkit's NCCL/CUDA paths on whatever GPUs are visible.
# Needs a CUDA build of torch and Horovod built with HOROVOD_GPU_OPERATIONS=NCCL (the pinned
# CPU stack of scripts/setup.sh has neither). Writes everything under ${OUT:-gpu-results}.
set -euo pipefail
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
python -m hvdkit doctor | tee "$OUT/doctor.txt" || true
python - <<'PY' | tee "$OUT/cuda.txt"
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda)
print("nccl", torch.distributed.is_nccl_available())
PY
GPUS="$(python -c 'import torch; print(torch.cuda.device_count())')"
if [ "$GPUS" -lt 1 ]; then echo "no GPU visible" >&2; exit 1; fi
# One rank per GPU: NCCL refuses two ranks on one device.
NP="$GPUS"
python -m hvdkit run -np "$NP" --backend ddp --model cnn --epochs 2 --num-samples 8192 --batch-size 128 | tee "$OUT/ddp.txt"
python -m hvdkit run -np "$NP" --backend horovod --controller mpi --model cnn --epochs 2 --num-samples 8192 \
    --batch-size 128 | tee "$OUT/horovod.txt"
if [ "$NP" -ge 2 ]; then
  python -m hvdkit bench --quick --np "$NP" --out "$OUT/bench" | tee "$OUT/bench.txt"
else
  # a single GPU: no allreduce to measure; checkpoint I/O of a GPU-sized model still applies
  python -m hvdkit bench --quick --np 2 --only ckpt --out "$OUT/bench" | tee "$OUT/bench.txt"
fi
