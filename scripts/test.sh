#!/usr/bin/env bash
# Everything the tests need, then the tests: set-up (idempotent, cached),
# the local Slurm cluster, and pytest. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
"$ROOT/scripts/local-slurm.sh" up
# shellcheck disable=SC1091
source "${HVDKIT_VENV:-$ROOT/.venv}/bin/activate"
cd "$ROOT"
exec python -m pytest -q -p no:cacheprovider "$@"
