#!/usr/bin/env bash
# One-shot, idempotent environment set-up for hvdkit on Debian/Ubuntu.
#
#   1. system packages (Open MPI, Slurm + munge, shellcheck, hdf5-tools)
#   2. a virtualenv with torch==2.13.0 (CPU build) and the build tools
#   3. Horovod 0.28.1 built with the C++17 patch, as a wheel cached under
#      $HVDKIT_CACHE keyed by horovod+torch+python version (rebuilt never twice)
#   4. mpi4py built against the system Open MPI, then hvdkit itself (editable)
#
# Environment knobs: HVDKIT_VENV (default ./.venv), HVDKIT_CACHE
# (default ~/.cache/hvdkit), HVDKIT_SKIP_APT=1 to skip system packages,
# HVDKIT_CUDA=auto|none|12|13 (GPU machines: CUDA torch + Horovod with NCCL ops; see
# scripts/setup_plan.py), HVDKIT_TORCH_INDEX (a torch wheel index for the CUDA build).
# `scripts/setup.sh --plan` prints what would be installed and built, and changes nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PLAN_PY="$(command -v python3.11 || command -v python3)"
if [ "${1:-}" = "--plan" ]; then
  exec "$PLAN_PY" "$ROOT/scripts/setup_plan.py" --explain
fi
PLAN="$("$PLAN_PY" "$ROOT/scripts/setup_plan.py")" || exit 2
eval "$PLAN"
VENV="${HVDKIT_VENV:-$ROOT/.venv}"
CACHE="${HVDKIT_CACHE:-$HOME/.cache/hvdkit}"
PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="2.13.0"
HOROVOD_VERSION="0.28.1"

log() { printf '[setup] %s\n' "$*"; }
# Tools' own output (pip, setuptools warnings, apt, compilers) goes to a log file; on failure
# its tail is shown, with the file's name. Only the [setup] lines reach the terminal.
SETUP_LOG="${HVDKIT_SETUP_LOG:-${TMPDIR:-/tmp}/hvdkit-setup.log}"
: >"$SETUP_LOG"
quiet() {
  if ! "$@" >>"$SETUP_LOG" 2>&1; then
    tail -n 40 "$SETUP_LOG" >&2
    log "FAILED: $* (whole log: $SETUP_LOG)"
    exit 1
  fi
}
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# --- 1. system packages -------------------------------------------------------
# openssh-server + iproute2 + util-linux: the local multi-node cluster (scripts/local-cluster.sh)
APT_PACKAGES=(openmpi-bin libopenmpi-dev slurm-wlm munge shellcheck hdf5-tools openssh-server openssh-client iproute2 util-linux)
need_apt=0
for cmd in mpirun mpicc sbatch slurmctld munged shellcheck h5dump /usr/sbin/sshd ssh ip nsenter; do
  command -v "$cmd" >/dev/null 2>&1 || need_apt=1
done
if [ "${HVDKIT_SKIP_APT:-0}" != 1 ] && [ "$need_apt" = 1 ]; then
  log "installing system packages: ${APT_PACKAGES[*]}"
  quiet as_root apt-get update -qq
  quiet as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${APT_PACKAGES[@]}"
else
  log "system packages present"
fi

# --- 2. virtualenv + torch ------------------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)
# the torch wanted: this version, and CUDA major $PLAN_CUDA ("none": the CPU build)
TORCH_OK="import torch,sys; c=torch.version.cuda; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' or (c.split('.')[0] if c else 'none') != '$PLAN_CUDA')"
if ! "$PY" -c "$TORCH_OK" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION (cuda: $PLAN_CUDA; $PLAN_REASON) and build tools"
  quiet "${PIP[@]}" install --upgrade pip
  # shellcheck disable=SC2086  # PLAN_TORCH_PIP_ARGS is a list of words from setup_plan.py
  quiet "${PIP[@]}" install $PLAN_TORCH_PIP_ARGS "$PLAN_TORCH_SPEC"
  quiet "${PIP[@]}" install numpy setuptools wheel 'cmake>=3.13,<4' packaging
else
  log "torch $TORCH_VERSION present (cuda: $PLAN_CUDA)"
fi

# --- 3. Horovod, patched for C++17, cached as a wheel --------------------------
PYTAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
# Patches applied to the sdist; part of the cache key and recorded in the venv, so a
# change here rebuilds once and an older build is never mistaken for this one.
HOROVOD_PATCHES="cxx17+gloo-iface+wait-cv+gloo-backoff+elastic-slots2+check-cache"
# CPU key unchanged; a CUDA build adds -cu<major>-sm<archs> (PLAN_CACHE_SUFFIX)
WHEEL_DIR="$CACHE/wheels/horovod-$HOROVOD_VERSION-$HOROVOD_PATCHES-torch$TORCH_VERSION-$PYTAG$PLAN_CACHE_SUFFIX"
PATCH_MARK="$VENV/.hvdkit-horovod-patches"
if [ "$(cat "$PATCH_MARK" 2>/dev/null)" = "$HOROVOD_PATCHES$PLAN_CACHE_SUFFIX" ] && "$PY" - <<PYEOF 2>/dev/null
import sys, horovod, horovod.torch as hvd
sys.exit(horovod.__version__ != "$HOROVOD_VERSION" or not hvd.gloo_built()
         or hvd.nccl_built() != ("$PLAN_CUDA" != "none"))
PYEOF
then
  log "horovod $HOROVOD_VERSION (torch, gloo) present"
else
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    log "building horovod $HOROVOD_VERSION wheel with C++17 (a few minutes, done once)"
    BUILD="$(mktemp -d)"
    trap 'rm -rf "$BUILD"' EXIT
    quiet "${PIP[@]}" download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD"
    tar -xzf "$BUILD"/horovod-"$HOROVOD_VERSION".tar.gz -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    "$ROOT/scripts/patch_horovod.sh" "$SRC"
    GPU_ENV=()
    if [ "$PLAN_CUDA" != none ]; then
      # NCCL ops against the NCCL torch's CUDA wheels brought (nvidia-nccl-cu*); pip's CUDA
      # compiler where no nvcc exists. Not yet run on a GPU machine: benchmarks/gpu_check.sh
      # is the check that builds this way there.
      # shellcheck disable=SC2086
      [ -z "$PLAN_EXTRA_PACKAGES" ] || quiet "${PIP[@]}" install $PLAN_EXTRA_PACKAGES
      read -r -a GPU_ENV <<<"$PLAN_HOROVOD_ENV"
      CUDA_VARS="$("$PY" "$ROOT/scripts/cuda_home.py" "$BUILD/cuda")"  # fails loudly if none
      mapfile -t -O "${#GPU_ENV[@]}" GPU_ENV <<<"$CUDA_VARS"
    fi
    rm -rf "$WHEEL_DIR.tmp"  # an interrupted build leaves it half-written
    mkdir -p "$WHEEL_DIR"
    # shellcheck disable=SC2016  # $0/$@ belong to the inner bash: cd there, then run the rest
    quiet bash -c 'cd "$0" && exec "$@"' "$SRC" env "${GPU_ENV[@]}" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
      MAKEFLAGS="-j$(nproc)" "$PY" -m pip --disable-pip-version-check wheel -q \
      --no-build-isolation --no-deps -w "$WHEEL_DIR.tmp" .
    mv "$WHEEL_DIR.tmp"/horovod-*.whl "$WHEEL_DIR"/ && rm -rf "$WHEEL_DIR.tmp"
  fi
  log "installing cached horovod wheel from $WHEEL_DIR"
  quiet "${PIP[@]}" install --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
  quiet "${PIP[@]}" install cloudpickle psutil pyyaml cffi   # horovod's runtime deps
  echo "$HOROVOD_PATCHES$PLAN_CACHE_SUFFIX" >"$PATCH_MARK"
fi

# --- 4. mpi4py against the system MPI, then hvdkit ---------------------------------
if ! "$PY" -c "import mpi4py.MPI" 2>/dev/null; then
  log "building mpi4py against $(command -v mpicc)"
  quiet env MPICC="$(command -v mpicc)" "${PIP[@]}" install --no-binary mpi4py mpi4py
fi
log "installing hvdkit (editable) with its extras (horovod and mpi4py are the ones built above; ray)"
quiet "${PIP[@]}" install -e "${ROOT}[test,horovod,mpi,plots,ray]"
log "done: activate with 'source $VENV/bin/activate'"
