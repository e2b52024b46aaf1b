#!/bin/bash
# usage: memory_budget.sh BYTES COMMAND...
# Run COMMAND in a memory cgroup (v1) of its own, limited to BYTES: one rank's memory budget.
# The cgroup is named by the job and the rank (Slurm's, or mpirun's with HVDKIT_BUDGET_TAG naming
# the run), so the test removes exactly the ones it made.
set -euo pipefail
limit=$1
shift
job="${SLURM_JOB_ID:-${HVDKIT_BUDGET_TAG:?}}"
rank="${SLURM_PROCID:-${OMPI_COMM_WORLD_RANK:?}}"
cg="/sys/fs/cgroup/memory/hvdkit-budget-${job}-${rank}"
mkdir -p "$cg"
echo "$limit" >"$cg/memory.limit_in_bytes"
echo $$ >"$cg/cgroup.procs"
exec "$@"
