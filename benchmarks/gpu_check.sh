#!/usr/bin/env bash
# The GPU check: hvdkit on one (or more) NVIDIA GPUs, both backends, fp32 and bf16, a checkpoint
# and an exact resume of CUDA tensors, samples/s. Sized for one 10-minute command on a bare
# machine with a GPU, Python 3.12, a preinstalled CUDA torch, nvcc and CMake, and no network.
#
#   benchmarks/gpu_check.sh prepare   # here: wheels (cp312) + Horovod sdist into .gpu-carry/
#   benchmarks/gpu_check.sh run       # there: build Horovod with NCCL, run, write $OUT
#
# With the device tool: run(command="bash benchmarks/gpu_check.sh run", carry=[".gpu-carry"],
# timeout_s=600). Results: $OUT/summary.txt, summary.json, doctor.txt, runs.log, build.log.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="$ROOT/.gpu-carry"
OUT="${OUT:-$ROOT/gpu-results}"
HOROVOD_VERSION="0.28.1"
DEPS=(h5py click jinja2 markupsafe pyyaml cloudpickle psutil cffi pycparser packaging numpy setuptools wheel)
log() { printf '[gpu-check] %s\n' "$*" | tee -a "$OUT/runs.log"; }

prepare() {
  mkdir -p "$CARRY"
  grep -qxF '/.gpu-carry/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.gpu-carry/' >>"$ROOT/.git/info/exclude"
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$CARRY" "${DEPS[@]}"
  python3 -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$CARRY"
  du -sh "$CARRY"
}

# one training run; its metrics JSON lands in $OUT/runs/NAME.json
train() {
  local name="$1" backend="$2"
  shift 2
  local argv=(python -m hvdkit train --backend "$backend" --model cnn --num-samples 16384 --batch-size 256
              --epochs 2 --metrics-file "$OUT/runs/$name.json" "$@")
  if [ "$backend" = horovod ]; then
    argv=(horovodrun -np "$NP" -H "localhost:$NP" --gloo "${argv[@]}")
  elif [ "$NP" -gt 1 ]; then  # DDP over several GPUs: torchrun's variables, which hvdkit reads
    argv=(python -m torch.distributed.run --standalone --nproc-per-node "$NP" "${argv[@]:1}")
  fi
  log "run $name: ${argv[*]}"
  timeout 240 "${argv[@]}" >>"$OUT/runs.log" 2>&1 || log "run $name FAILED (exit $?)"
}

run() {
  mkdir -p "$OUT/runs"
  : >"$OUT/runs.log"
  log "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
  # a venv that sees the preinstalled CUDA torch; everything else from the carried wheels
  python3 -m venv --system-site-packages /tmp/gpuvenv
  # shellcheck disable=SC1091
  source /tmp/gpuvenv/bin/activate
  pip install -q --no-index --find-links "$CARRY" "${DEPS[@]}" >>"$OUT/build.log" 2>&1
  python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.device_count(), "GPU(s)")' | tee -a "$OUT/runs.log"
  NP="$(python -c 'import torch; print(torch.cuda.device_count())')"  # one rank per GPU: NCCL refuses two on one
  export PYTHONPATH="$ROOT" PYTHONUNBUFFERED=1

  log "building horovod $HOROVOD_VERSION with NCCL ops (log: build.log)"
  local build=/tmp/hvd-build
  rm -rf "$build" && mkdir -p "$build"
  tar -xzf "$CARRY/horovod-$HOROVOD_VERSION.tar.gz" -C "$build"
  "$ROOT/scripts/patch_horovod.sh" "$build/horovod-$HOROVOD_VERSION"
  local cuda_vars mpi_flag=HOROVOD_WITHOUT_MPI=1
  cuda_vars="$(python "$ROOT/scripts/cuda_home.py" "$build/cuda")"
  if command -v mpicc >/dev/null 2>&1; then mpi_flag=HOROVOD_WITH_MPI=1; fi
  local arch
  arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)"
  local t0=$SECONDS
  local cuda_env
  mapfile -t cuda_env <<<"$cuda_vars"
  if (cd "$build/horovod-$HOROVOD_VERSION" && env "${cuda_env[@]}" HOROVOD_GPU_OPERATIONS=NCCL \
        HOROVOD_BUILD_CUDA_CC_LIST="$arch" HOROVOD_NCCL_LINK=SHARED HOROVOD_WITH_PYTORCH=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 \
        "$mpi_flag" MAKEFLAGS="-j$(nproc)" \
        timeout 420 pip install -q --no-build-isolation --no-deps . ) >>"$OUT/build.log" 2>&1; then
    log "horovod built in $((SECONDS - t0)) s"
  else
    log "horovod build FAILED after $((SECONDS - t0)) s (see build.log); DDP runs only"
  fi
  timeout 120 python -m hvdkit doctor >"$OUT/doctor.txt" 2>&1 || true

  local backends=(ddp)
  python -c 'import horovod.torch as h, sys; sys.exit(not h.nccl_built())' 2>/dev/null && backends+=(horovod)
  for backend in "${backends[@]}"; do
    for precision in fp32 bf16; do
      train "$backend-$precision" "$backend" --precision "$precision"
    done
    # checkpoint + exact resume of CUDA tensors: stop at step 20, resume, compare with straight
    train "$backend-straight" "$backend" --checkpoint-dir "/tmp/ck-$backend-a"
    train "$backend-stop20" "$backend" --checkpoint-dir "/tmp/ck-$backend-b" --max-steps 20
    train "$backend-resumed" "$backend" --checkpoint-dir "/tmp/ck-$backend-b"
  done
  python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))}
rows, summary = [], {"runs": {}}
for name, m in runs.items():
    sps = m.get("samples_per_sec") or [float("nan")]
    summary["runs"][name] = {"final_loss": m["final_loss"], "samples_per_sec_last_epoch": sps[-1],
                             "digest": m["param_digest"], "world": m["world_size"]}
    rows.append(f"{name:<18} world {m['world_size']}  loss {m['final_loss']:.6f}  "
                f"{sps[-1]:>10.1f} samples/s  digest {m['param_digest']}")
for backend in ("ddp", "horovod"):
    a, b = runs.get(f"{backend}-straight"), runs.get(f"{backend}-resumed")
    if a and b:
        same = a["param_digest"] == b["param_digest"] and a["final_loss"] == b["final_loss"]
        summary[f"{backend}_resume_exact"] = same
        rows.append(f"{backend}: resume after step 20 {'EXACT' if same else 'DIFFERS'} "
                    f"({a['param_digest']} vs {b['param_digest']})")
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
(out / "summary.txt").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
  rm -rf "$OUT/runs"  # the figures are in summary.json; keep what comes back under 8 files
}

case "${1:-}" in
  prepare) prepare ;;
  run) mkdir -p "$OUT"; run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
