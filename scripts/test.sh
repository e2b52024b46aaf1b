#!/usr/bin/env bash
# Everything the tests need, then the tests: set-up (idempotent, cached),
# the local 2-node Slurm cluster, pytest, and the cluster's teardown (by recorded PIDs)
# whatever pytest did. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
# The tests see a new machine's home: nothing an earlier run or earlier work left in ~/.ray,
# ~/.cache or ~/.config can make them pass. What set-up may reuse (the Horovod wheel) was
# found above through the real home, and is named explicitly for anything that needs it again.
export HVDKIT_CACHE="${HVDKIT_CACHE:-$HOME/.cache/hvdkit}"
TEST_HOME="$(mktemp -d "${TMPDIR:-/tmp}/hvdkit-test-home.XXXXXX")"
trap 'rm -rf "$TEST_HOME"' EXIT
export HOME="$TEST_HOME" XDG_CACHE_HOME="$TEST_HOME/.cache" XDG_CONFIG_HOME="$TEST_HOME/.config" \
  XDG_DATA_HOME="$TEST_HOME/.local/share" XDG_STATE_HOME="$TEST_HOME/.local/state"
"$ROOT/scripts/local-cluster.sh" up --nodes 2
trap '"$ROOT/scripts/local-cluster.sh" down; rm -rf "$TEST_HOME"' EXIT
# shellcheck disable=SC1091
source "${HVDKIT_VENV:-$ROOT/.venv}/bin/activate"
cd "$ROOT"
# lint and types first: seconds, and a finding fails the run like a test (rules: pyproject.toml)
shellcheck scripts/*.sh .ci/run
ruff check hvdkit tests
mypy
# two workers (HVDKIT_TEST_WORKERS; 0 runs one process): the Slurm and Ray tests form one serial
# group beside the rest, grouped by module (tests/conftest.py); the machine has 2 cores and those
# tests mostly wait on a queue or a daemon
python -m pytest -q -p no:cacheprovider -n "${HVDKIT_TEST_WORKERS:-2}" --dist loadgroup --durations=25 "$@"
