#!/bin/bash
# usage: memory_budget.sh BYTES COMMAND...
# Run COMMAND in a memory cgroup (v1) of its own, limited to BYTES: one rank's memory budget.
# The cgroup is named by the Slurm job and task, so the test removes exactly the ones it made.
set -euo pipefail
limit=$1
shift
cg="/sys/fs/cgroup/memory/hvdkit-budget-${SLURM_JOB_ID:?}-${SLURM_PROCID:?}"
mkdir -p "$cg"
echo "$limit" >"$cg/memory.limit_in_bytes"
echo $$ >"$cg/cgroup.procs"
exec "$@"
