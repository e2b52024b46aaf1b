#!/usr/bin/env bash
# Start (or stop) a real single-node Slurm cluster on this machine for tests:
# munge + slurmctld + slurmd, as verified in shared/ENVIRONMENT.md.
#   scripts/local-slurm.sh up      idempotent; waits until the node is idle
#   scripts/local-slurm.sh down
# It never overwrites a slurm.conf it did not write itself.
set -euo pipefail
MARK="# written by hvdkit scripts/local-slurm.sh"
CONF=/etc/slurm/slurm.conf
log() { printf '[local-slurm] %s\n' "$*"; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

up() {
  command -v slurmctld >/dev/null || { echo "slurmctld not installed: run scripts/setup.sh" >&2; exit 1; }
  # munge: key, dirs, daemon
  if [ ! -s /etc/munge/munge.key ]; then
    as_root mkdir -p /etc/munge
    as_root dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  as_root mkdir -p /run/munge /var/log/munge /var/lib/munge
  as_root chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
  as_root chmod 400 /etc/munge/munge.key
  as_root chmod 755 /run/munge
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    as_root su -s /bin/sh munge -c munged
    sleep 1
  fi
  munge -n | unmunge | grep -q 'STATUS: *Success'

  host="$(hostname -s)"
  if [ ! -f "$CONF" ] || grep -q "^$MARK" "$CONF"; then
    as_root mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    as_root tee "$CONF" >/dev/null <<CONFEOF
$MARK
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
SlurmctldParameters=preempt_send_user_signal
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONFEOF
  else
    log "keeping existing $CONF (not written by hvdkit)"
  fi
  pgrep -x slurmctld >/dev/null || as_root slurmctld
  pgrep -x slurmd >/dev/null || as_root slurmd
  for _ in $(seq 1 60); do
    if sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
      log "node $host is up: $(sinfo -h -o '%P %t %c CPUs')"
      return 0
    fi
    as_root scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  echo "Slurm did not come up; see /var/log/slurm/*.log" >&2
  exit 1
}

down() {
  as_root pkill -x slurmd || true
  as_root pkill -x slurmctld || true
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
