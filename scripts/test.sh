#!/usr/bin/env bash
# Everything the tests need, then the tests: set-up (idempotent, cached),
# the local 2-node Slurm cluster, pytest, and the cluster's teardown (by recorded PIDs)
# whatever pytest did. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
"$ROOT/scripts/local-cluster.sh" up --nodes 2
trap '"$ROOT/scripts/local-cluster.sh" down' EXIT
# shellcheck disable=SC1091
source "${HVDKIT_VENV:-$ROOT/.venv}/bin/activate"
cd "$ROOT"
# lint and types first: seconds, and a finding fails the run like a test (rules: pyproject.toml)
shellcheck scripts/*.sh .ci/run
ruff check hvdkit tests
mypy
python -m pytest -q -p no:cacheprovider --durations=25 "$@"
