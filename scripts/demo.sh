#!/usr/bin/env bash
# The main job: the same 2-rank training through Horovod (horovodrun) and
# through native DDP (mpirun + mpi4py rendezvous), loss per epoch and samples/s.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "${HVDKIT_VENV:-$ROOT/.venv}/bin/activate"
ARGS=(--model "${MODEL:-mlp}" --epochs "${EPOCHS:-3}" --num-samples 2048 --batch-size 32)
echo "=== Horovod: hvdkit run -np 2 --backend horovod ${ARGS[*]}"
hvdkit run -np 2 --backend horovod "${ARGS[@]}"
echo "=== DDP: hvdkit run -np 2 --backend ddp ${ARGS[*]}"
hvdkit run -np 2 --backend ddp "${ARGS[@]}"
