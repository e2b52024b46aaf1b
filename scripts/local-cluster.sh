#!/usr/bin/env bash
# A real N-node Slurm cluster on this one machine, for tests, demos and laptops.
#
#   scripts/local-cluster.sh up [--nodes N] [--link RATE[,DELAY]]
#                                              N nodes (default 2); idempotent; waits until idle;
#                                              --link shapes the fabric as `link` does
#   scripts/local-cluster.sh link RATE[,DELAY]|off
#                                              every node's fabric interface (eth1) sends at most
#                                              RATE (1gbit, 10gbit, 500mbit: a tbf qdisc in the
#                                              node), plus DELAY (50us, 1ms: netem) where the
#                                              kernel has sch_netem; `off` removes it. The link
#                                              in use is in $STATE/link and in `status`
#   scripts/local-cluster.sh status            nodes, addresses, daemons and Slurm's view
#   scripts/local-cluster.sh exec NODE -- CMD  run CMD "on" NODE (its hostname and network)
#   scripts/local-cluster.sh pids NODE         PIDs of every process on NODE (its namespace)
#   scripts/local-cluster.sh kill-node NODE     crash NODE: its slurmd, sshd and every task on it
#   scripts/local-cluster.sh revive NODE        "reboot" NODE: slurmd and sshd again, node resumed
#   scripts/local-cluster.sh down              stop everything it started, by recorded PID
#   scripts/local-cluster.sh ray-up            a Ray cluster on the nodes: head on node1, a worker on
#                                              every other node, over the fabric; waits until all joined;
#                                              token authentication with a token of its own: join
#                                              with RAY_AUTH_TOKEN_PATH=$STATE/ray-token
#   scripts/local-cluster.sh ray-down          stop it (each node's Ray by its recorded PID's group)
#
# Each node is a Linux network namespace plus a UTS namespace (so `hostname` prints node1,
# node2, ...). A holder process keeps the UTS namespace alive; its PID is the node's handle.
# Every node has two interfaces, each a veth pair into a bridge in the root namespace:
#   eth0  management  10.233.1.K/24  bridge hvk-mgmt (the root namespace is 10.233.1.254:
#                                    slurmctld, sbatch and ssh from this machine go here)
#   eth1  fabric      10.233.2.K/24  bridge hvk-fab (nodes only: what --iface eth1 selects)
# The subnets exist only on these bridges; nodes have no default route, so no traffic leaves.
# Names resolve everywhere through a marked /etc/hosts block (nodeK, nodeK-fab).
# One slurmd -N nodeK per node inside its namespaces, one slurmctld in the root namespace,
# munge shared (its socket is a file), an sshd per node with a key made at `up` (ssh client
# settings in /etc/ssh/ssh_config.d/, never in the user's ~/.ssh). The real filesystem plays
# the cluster's shared file system.
#
# Where namespaces cannot be made (no CAP_NET_ADMIN, no iproute2), `up` prints one loud
# line and starts a single-node cluster on this host instead (mode=single in `status`),
# so single-node Slurm tests still run and multi-node tests skip saying why.
#
# Every daemon is started by this script with its PID recorded under $STATE/pids and is
# stopped by that PID; nothing is ever stopped by name. Processes left inside a node's
# namespace (job steps) are found by namespace membership (`ip netns pids`) and killed by PID.
set -euo pipefail

STATE="${HVDKIT_CLUSTER_STATE:-/run/hvdkit-cluster}"
CONF=/etc/slurm/slurm.conf
SSH_DROPIN=/etc/ssh/ssh_config.d/hvdkit-cluster.conf
MARK="# written by hvdkit scripts/local-cluster.sh"
HOSTS_BEGIN="# BEGIN hvdkit local-cluster"
HOSTS_END="# END hvdkit local-cluster"
MGMT_NET=10.233.1
FAB_NET=10.233.2
CTL_ADDR="$MGMT_NET.254"
CPUS_PER_NODE="${HVDKIT_CLUSTER_CPUS:-4}"   # declared, not real: oversubscription is expected
MAX_NODES=8

log() { printf '[local-cluster] %s\n' "$*"; }
die() { printf '[local-cluster] error: %s\n' "$*" >&2; exit 1; }
need_root() { [ "$(id -u)" -eq 0 ] || die "must run as root (namespaces, bridges, daemons); HINT: sudo $0 $*"; }

pidfile() { printf '%s/pids/%s.pid' "$STATE" "$1"; }
alive() { local f; f="$(pidfile "$1")"; [ -s "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null; }
nodes_count() { cat "$STATE/nodes" 2>/dev/null || echo 0; }
mode() { cat "$STATE/mode" 2>/dev/null || echo none; }

# start NAME CMD...: run CMD in the background in a new session, record its PID as NAME.
# setsid and nsenter exec (they do not fork here), so $! is the daemon's own PID.
start() {
  local name="$1"; shift
  setsid "$@" >"$STATE/log/$name.out" 2>&1 </dev/null &
  echo $! >"$(pidfile "$name")"
}

# stop NAME: TERM the recorded PID, KILL after 10 s, forget it.
stop() {
  local f pid
  f="$(pidfile "$1")"
  [ -s "$f" ] || return 0
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

node_pid() { cat "$(pidfile "holder-$1")" 2>/dev/null || die "node $1 is not up (see: $0 status)"; }
in_node() { local node="$1"; shift; nsenter -t "$(node_pid "$node")" -n -u -- "$@"; }

namespaces_work() {
  command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null || return 1
  local probe="hvk-probe-$$" ok=0
  ip netns add "$probe" 2>/dev/null || return 1
  ip link add "hvk-p$$" type veth peer name eth9 netns "$probe" 2>/dev/null && ok=1
  ip link del "hvk-p$$" 2>/dev/null || true
  ip netns del "$probe" 2>/dev/null || true
  [ "$ok" = 1 ] && unshare --uts true 2>/dev/null
}

# --- /etc/hosts and ssh client settings (marked blocks, removed by down) -------------------
write_hosts_block() {
  local n="$1" tmp k
  tmp="$(mktemp)"
  sed "/^$HOSTS_BEGIN\$/,/^$HOSTS_END\$/d" /etc/hosts >"$tmp"
  {
    echo "$HOSTS_BEGIN"
    for k in $(seq 1 "$n"); do
      echo "$MGMT_NET.$k node$k"
      echo "$FAB_NET.$k node$k-fab"
    done
    echo "$HOSTS_END"
  } >>"$tmp"
  cat "$tmp" >/etc/hosts   # in place: /etc/hosts is often a bind mount that rename cannot replace
  rm -f "$tmp"
}

remove_hosts_block() {
  grep -q "^$HOSTS_BEGIN\$" /etc/hosts 2>/dev/null || return 0
  local tmp; tmp="$(mktemp)"
  sed "/^$HOSTS_BEGIN\$/,/^$HOSTS_END\$/d" /etc/hosts >"$tmp"
  cat "$tmp" >/etc/hosts
  rm -f "$tmp"
}

setup_ssh() {
  local n="$1" k
  command -v /usr/sbin/sshd >/dev/null || die "sshd not installed; HINT: apt-get install openssh-server (scripts/setup.sh does)"
  mkdir -p "$STATE/ssh" /run/sshd
  chmod 700 "$STATE/ssh"
  [ -s "$STATE/ssh/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C hvdkit-cluster -f "$STATE/ssh/id_ed25519"
  [ -s "$STATE/ssh/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C hvdkit-cluster-host -f "$STATE/ssh/host_ed25519"
  cp "$STATE/ssh/id_ed25519.pub" "$STATE/ssh/authorized_keys"
  cat >"$STATE/ssh/sshd_config" <<EOF
$MARK
Port 22
ListenAddress 0.0.0.0
HostKey $STATE/ssh/host_ed25519
PidFile none
AuthorizedKeysFile $STATE/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitUserEnvironment no
X11Forwarding no
PrintMotd no
EOF
  : >"$STATE/ssh/known_hosts"
  local hosts=()
  for k in $(seq 1 "$n"); do
    hosts+=("node$k" "node$k-fab" "$MGMT_NET.$k" "$FAB_NET.$k")
    echo "node$k,node$k-fab,$MGMT_NET.$k,$FAB_NET.$k $(cut -d' ' -f1,2 "$STATE/ssh/host_ed25519.pub")" >>"$STATE/ssh/known_hosts"
  done
  mkdir -p "$(dirname "$SSH_DROPIN")"
  cat >"$SSH_DROPIN" <<EOF
$MARK; removed by its 'down'
Host ${hosts[*]}
    IdentityFile $STATE/ssh/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $STATE/ssh/known_hosts
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 10
    LogLevel ERROR
EOF
}

# --- munge ------------------------------------------------------------------------------------
start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munge already running (not started here, so not stopped by down)"
    return 0
  fi
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
  chmod 400 /etc/munge/munge.key
  chmod 755 /run/munge
  start munged setpriv --reuid=munge --regid=munge --init-groups munged -F
  for _ in $(seq 1 50); do
    munge -n 2>/dev/null | unmunge 2>/dev/null | grep -q 'STATUS: *Success' && return 0
    sleep 0.2
  done
  die "munged did not start; see $STATE/log/munged.out"
}

# --- slurm.conf ---------------------------------------------------------------------------------
write_slurm_conf() {
  local n="$1" ctl_host k
  if [ -f "$CONF" ] && ! grep -q "^# written by hvdkit" "$CONF"; then
    die "$CONF exists and was not written by hvdkit; HINT: move it away (it is never overwritten)"
  fi
  ctl_host="$(hostname -s)"
  mkdir -p /etc/slurm "$STATE/spool" "$STATE/log"
  {
    echo "$MARK (mode $(mode), $n node(s))"
    cat <<EOF
ClusterName=hvdkit
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=$STATE/spool/slurmctld
SlurmctldPidFile=$STATE/spool/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdPidFile=$STATE/spool/slurmd-%n.pid
SlurmdSpoolDir=$STATE/spool/slurmd-%n
SlurmdLogFile=$STATE/log/slurmd-%n.log
TmpFS=$STATE/tmp/%n
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
MessageTimeout=10
SlurmdTimeout=20
InactiveLimit=0
SlurmctldParameters=preempt_send_user_signal
EOF
    if [ "$(mode)" = multi ]; then
      echo "SlurmctldHost=$ctl_host($CTL_ADDR)"
      for k in $(seq 1 "$n"); do
        echo "NodeName=node$k NodeAddr=$MGMT_NET.$k Port=6818 CPUs=$CPUS_PER_NODE State=UNKNOWN"
      done
      echo "PartitionName=debug Nodes=node[1-$n] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
    else
      echo "SlurmctldHost=$ctl_host"
      echo "NodeName=$ctl_host CPUs=$CPUS_PER_NODE State=UNKNOWN"
      echo "PartitionName=debug Nodes=$ctl_host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
    fi
  } >"$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
}

# --- nodes -----------------------------------------------------------------------------------------
make_bridge() {  # name, root address or ""
  ip link show "$1" >/dev/null 2>&1 || ip link add "$1" type bridge
  ip link set "$1" up
  if [ -n "$2" ] && ! ip -4 addr show dev "$1" | grep -q "inet $2/"; then ip addr add "$2/24" dev "$1"; fi
}

make_node() {
  local k="$1"
  local ns="hvk-node$k"
  ip netns add "$ns"
  mkdir -p "$STATE/spool/slurmd-node$k" "$STATE/tmp/node$k"
  # eth0: management, eth1: fabric; the root-side ends are hvk-nK-m / hvk-nK-f on the bridges
  ip link add "hvk-n$k-m" type veth peer name eth0 netns "$ns"
  ip link add "hvk-n$k-f" type veth peer name eth1 netns "$ns"
  ip link set "hvk-n$k-m" master hvk-mgmt up
  ip link set "hvk-n$k-f" master hvk-fab up
  ip -n "$ns" addr add "$MGMT_NET.$k/24" dev eth0
  ip -n "$ns" addr add "$FAB_NET.$k/24" dev eth1
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set eth1 up
  # The holder owns the node's UTS namespace (hostname nodeK); everything on the node enters
  # its namespaces with nsenter -t <holder>. Killing it (down) ends the node.
  start "holder-node$k" nsenter --net="/run/netns/$ns" unshare --uts \
    sh -c "hostname node$k && exec sleep infinity"
  for _ in $(seq 1 50); do
    [ "$(in_node "node$k" hostname 2>/dev/null)" = "node$k" ] && return 0
    sleep 0.1
  done
  die "node$k did not come up (hostname never became node$k)"
}

wait_idle() {
  local want="$1"
  for _ in $(seq 1 90); do
    local idle
    idle="$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)/' | wc -l)"
    [ "$idle" -ge "$want" ] && return 0
    # nodes left DOWN/DRAIN by an earlier run come back once their slurmd answers
    scontrol update nodename=ALL state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  sinfo -N >&2 || true
  die "Slurm nodes did not become idle; see $STATE/log/"
}

is_up() {
  local n="$1" k
  [ "$(nodes_count)" = "$n" ] && alive slurmctld || return 1
  if [ "$(mode)" = multi ]; then
    for k in $(seq 1 "$n"); do
      alive "holder-node$k" && alive "slurmd-node$k" && alive "sshd-node$k" || return 1
    done
  else
    alive slurmd || return 1
  fi
  sinfo -h >/dev/null 2>&1
}

start_node_daemons() {
  local k="$1"
  start "slurmd-node$k" nsenter -t "$(node_pid "node$k")" -n -u -- slurmd -D -N "node$k"
  start "sshd-node$k" nsenter -t "$(node_pid "node$k")" -n -u -- /usr/sbin/sshd -D -e -f "$STATE/ssh/sshd_config"
}

node_index() {
  if ! [[ "${1:-}" =~ ^node([1-9][0-9]*)$ ]] || [ "${BASH_REMATCH[1]}" -gt "$(nodes_count)" ]; then
    die "no node '${1:-}' in this cluster; HINT: $0 status lists them"
  fi
  [ "$(mode)" = multi ] || die "kill-node/revive need the multi-node mode"
  echo "${BASH_REMATCH[1]}"
}

# A node crash: every process in the node's namespace (slurmd, sshd, job steps, tasks) is
# SIGKILLed by PID at once; the holder stays, so the node's hostname and links survive.
kill_node() {
  need_root kill-node
  local k holder pid
  k="$(node_index "$1")"
  holder="$(node_pid "node$k")"
  for pid in $(ip netns pids "hvk-node$k"); do
    [ "$pid" = "$holder" ] || kill -KILL "$pid" 2>/dev/null || true
  done
  rm -f "$(pidfile "slurmd-node$k")" "$(pidfile "sshd-node$k")"
  log "node$k crashed (all its processes killed); '$0 revive node$k' brings it back"
}

revive_node() {
  need_root revive
  local k
  k="$(node_index "$1")"
  alive "slurmd-node$k" || start_node_daemons "$k"
  for _ in $(seq 1 60); do
    scontrol update nodename="node$k" state=resume >/dev/null 2>&1 || true
    sinfo -h -N -n "node$k" -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)' && { log "node$k is back"; return 0; }
    sleep 1
  done
  die "node$k did not come back; see $STATE/log/slurmd-node$k.log"
}

# --- the fabric's speed (tc in each node) ---------------------------------------------
RATE_RE='^([1-9][0-9]*)(kbit|mbit|gbit)$'
DELAY_RE='^([0-9]+)(us|ms)$'

check_link() {  # RATE[,DELAY] or off: refused in one line before anything changes
  local spec="$1" rate delay
  [ "$spec" = off ] && return 0
  rate="${spec%%,*}"; delay=""
  [ "$rate" != "$spec" ] && delay="${spec#*,}"
  [[ "$rate" =~ $RATE_RE ]] || die "--link $spec: RATE '$rate' is not a positive rate; HINT: use e.g. 1gbit, 10gbit or 500mbit (kbit, mbit, gbit)"
  if [ -n "$delay" ]; then
    [[ "$delay" =~ $DELAY_RE ]] || die "--link $spec: DELAY '$delay' is not a delay; HINT: use e.g. 50us or 1ms"
    netem_works || die "--link $spec: this kernel has no netem qdisc (sch_netem), so a DELAY cannot be emulated; HINT: give the RATE alone (--link $rate)"
  fi
}

netem_works() {  # probe in a throwaway namespace: the kernel may lack sch_netem
  local probe="hvk-netem$$" ok=0
  ip netns add "$probe" 2>/dev/null || return 1
  ip netns exec "$probe" tc qdisc add dev lo root netem delay 1us 2>/dev/null && ok=1
  ip netns del "$probe" 2>/dev/null || true
  [ "$ok" = 1 ]
}

rate_bits() {  # 1gbit -> 1000000000
  [[ "$1" =~ $RATE_RE ]]
  local n="${BASH_REMATCH[1]}"
  case "${BASH_REMATCH[2]}" in kbit) echo $((n * 1000)) ;; mbit) echo $((n * 1000000)) ;; gbit) echo $((n * 1000000000)) ;; esac
}

link() {  # RATE[,DELAY] | off, on every node's eth1
  need_root link
  local spec="${1:-}" n k rate delay burst
  [ -n "$spec" ] || die "usage: $0 link RATE[,DELAY]|off (e.g. 1gbit, 10gbit,20us, off)"
  check_link "$spec"
  n="$(nodes_count)"
  [ "$n" != 0 ] || die "the local cluster is not up, so there is no link to shape; HINT: $0 up --link $spec"
  [ "$(mode)" = multi ] || die "the local cluster runs in single-node mode (no namespaces): it has no fabric to shape"
  rate="${spec%%,*}"; delay=""
  [ "$rate" != "$spec" ] && delay="${spec#*,}"
  for k in $(seq 1 "$n"); do
    in_node "node$k" tc qdisc del dev eth1 root 2>/dev/null || true
    [ "$spec" = off ] && continue
    # burst: 10 ms at the rate, and at least one 64 KiB GSO segment (tbf drops a larger packet)
    burst=$(( $(rate_bits "$rate") / 8 / 100 ))
    [ "$burst" -ge 65536 ] || burst=65536
    if [ -n "$delay" ]; then
      in_node "node$k" tc qdisc add dev eth1 root handle 1: netem delay "$delay"
      in_node "node$k" tc qdisc add dev eth1 parent 1: handle 2: tbf rate "$rate" burst "$burst" latency 100ms
    else
      in_node "node$k" tc qdisc add dev eth1 root tbf rate "$rate" burst "$burst" latency 100ms
    fi
  done
  echo "$spec" >"$STATE/link"
  log "fabric link: ${spec} on eth1 of node1..node$n$([ "$spec" = off ] || printf ' (%s)' "$(in_node node1 tc qdisc show dev eth1 | head -1)")"
}

up() {
  need_root up
  local n=2 spec=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) n="${2:-}"; shift 2 ;;
      --nodes=*) n="${1#--nodes=}"; shift ;;
      --link) spec="${2:-}"; shift 2 ;;
      --link=*) spec="${1#--link=}"; shift ;;
      *) die "unknown option $1; HINT: usage: $0 up [--nodes N] [--link RATE[,DELAY]]" ;;
    esac
  done
  if ! [[ "$n" =~ ^[1-9][0-9]*$ ]] || [ "$n" -gt "$MAX_NODES" ]; then
    die "--nodes must be 1..$MAX_NODES, got '$n'"
  fi
  [ -z "$spec" ] || check_link "$spec"
  command -v slurmctld >/dev/null || die "Slurm not installed; HINT: run scripts/setup.sh"
  if is_up "$n"; then
    log "already up ($(mode), $n node(s))"
    [ -z "$spec" ] || link "$spec"
    return 0
  fi
  [ "$(nodes_count)" = 0 ] || down
  mkdir -p "$STATE/pids" "$STATE/log" "$STATE/spool"
  if namespaces_work; then
    echo multi >"$STATE/mode"
  else
    echo single >"$STATE/mode"
    n=1
    echo "!!! [local-cluster] MULTI-NODE UNAVAILABLE: network/UTS namespaces cannot be made here" \
         "(needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN, iproute2, util-linux);" \
         "started a single-node Slurm cluster instead; multi-node tests will be skipped !!!" >&2
  fi
  echo "$n" >"$STATE/nodes"
  start_munge
  write_slurm_conf "$n"
  if [ "$(mode)" = multi ]; then
    make_bridge hvk-mgmt "$CTL_ADDR"
    make_bridge hvk-fab ""
    write_hosts_block "$n"
    setup_ssh "$n"
    local k
    for k in $(seq 1 "$n"); do make_node "$k"; done
  fi
  start slurmctld slurmctld -D -i
  sleep 1
  if [ "$(mode)" = multi ]; then
    for k in $(seq 1 "$n"); do start_node_daemons "$k"; done
  else
    start slurmd slurmd -D
  fi
  wait_idle "$n"
  log "up: $(mode), $n node(s); $(sinfo -h -o '%P %D nodes %t' | paste -sd' ')"
  if [ -n "$spec" ]; then link "$spec"; else echo off >"$STATE/link"; fi
}

down() {
  need_root down
  local k n
  n="$(nodes_count)"
  for k in $(seq 1 "$MAX_NODES"); do stop_group "ray-node$k"; done
  rm -rf /tmp/ray-hvk-node* "$STATE/ray-token"
  for name in slurmctld slurmd; do stop "$name"; done
  for k in $(seq 1 "$MAX_NODES"); do
    stop "slurmd-node$k"
    stop "sshd-node$k"
    if ip netns list 2>/dev/null | grep -qw "hvk-node$k"; then
      # job steps and tasks still on the node: found by namespace, killed by PID
      for pid in $(ip netns pids "hvk-node$k" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    fi
    stop "holder-node$k"
    ip netns del "hvk-node$k" 2>/dev/null || true
    ip link del "hvk-n$k-m" 2>/dev/null || true
    ip link del "hvk-n$k-f" 2>/dev/null || true
  done
  stop munged
  ip link del hvk-mgmt 2>/dev/null || true
  ip link del hvk-fab 2>/dev/null || true
  remove_hosts_block
  if [ -f "$SSH_DROPIN" ] && grep -q "^# written by hvdkit" "$SSH_DROPIN"; then rm -f "$SSH_DROPIN"; fi
  if [ -f "$CONF" ] && grep -q "^# written by hvdkit" "$CONF"; then rm -f "$CONF"; fi
  rm -rf "$STATE"
  log "down (was ${n} node(s)): daemons stopped, namespaces, bridges, hosts lines and ssh settings removed"
}

# --- Ray on the nodes ----------------------------------------------------------------
RAY_PORT=6379
ray_bin() {
  local ray="${HVDKIT_VENV:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv}/bin/ray"
  [ -x "$ray" ] || die "no $ray; HINT: run scripts/setup.sh (it installs the [ray] extra)"
  printf '%s' "$ray"
}

# stop_group NAME: like stop, but TERM/KILL the recorded PID's whole process group (ray start
# --block leads raylet, GCS and workers, which it started in its own session)
stop_group() {
  local f pid
  f="$(pidfile "$1")"
  [ -s "$f" ] || return 0
  pid="$(cat "$f")"
  kill -TERM -- "-$pid" 2>/dev/null || true
  for _ in $(seq 1 25); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$f"
}

ray_up() {
  need_root ray-up
  [ "$(mode)" = multi ] || die "ray-up needs the multi-node cluster; HINT: $0 up first"
  local n k ray py head="$FAB_NET.1" token="$STATE/ray-token" watch=()
  n="$(nodes_count)"
  ray="$(ray_bin)"
  py="$(dirname "$ray")/python"
  if alive ray-node1; then log "ray already up (head $head:$RAY_PORT; token: RAY_AUTH_TOKEN_PATH=$token)"; return 0; fi
  # token authentication with a token made for this cluster, in a file only root reads (never
  # the user's ~/.ray); no dashboard; each node its own temp dir, as on real machines; CPUs as
  # Slurm declares them
  (umask 077 && "$py" -m hvdkit.rayrun.auth >"$token")
  start ray-node1 nsenter -t "$(node_pid node1)" -n -u -- env RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$token" \
    "$ray" start --head --block --node-ip-address "$head" --port "$RAY_PORT" --num-cpus "$CPUS_PER_NODE" \
    --include-dashboard false --disable-usage-stats --temp-dir "/tmp/ray-hvk-node1"
  for k in $(seq 2 "$n"); do
    start "ray-node$k" nsenter -t "$(node_pid "node$k")" -n -u -- env RAY_AUTH_MODE=token \
      RAY_AUTH_TOKEN_PATH="$token" "$ray" start --block --address "$head:$RAY_PORT" --node-ip-address "$FAB_NET.$k" \
      --num-cpus "$CPUS_PER_NODE" --disable-usage-stats --temp-dir "/tmp/ray-hvk-node$k"
  done
  for k in $(seq 1 "$n"); do watch+=(--watch "node$k" "$(cat "$(pidfile "ray-node$k")")" "$STATE/log/ray-node$k.out"); done
  # joined when the cluster itself counts n live nodes (polled, never a fixed sleep); a node
  # whose Ray exits ends the wait at once, quoting its log
  if ! in_node node1 env RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$token" \
      "$py" -m hvdkit.rayrun.cluster wait "$head:$RAY_PORT" "$n" 120 "${watch[@]}"; then
    ray_down
    die "Ray did not come up; see $STATE/log/ray-node*.out"
  fi
  log "ray up: head $head:$RAY_PORT (node1), $n node(s) joined; join with RAY_AUTH_TOKEN_PATH=$token; stop with: $0 ray-down"
}

ray_down() {
  need_root ray-down
  local k
  for k in $(seq 1 "$MAX_NODES"); do stop_group "ray-node$k"; done
  rm -rf /tmp/ray-hvk-node* "$STATE/ray-token"
  log "ray down"
}

status() {
  local n k
  n="$(nodes_count)"
  if [ "$n" = 0 ]; then echo "local cluster: down"; return 3; fi
  echo "local cluster: mode $(mode), $n node(s), fabric link $(cat "$STATE/link" 2>/dev/null || echo off), state in $STATE"
  printf '  %-10s %s\n' slurmctld "$(alive slurmctld && echo "pid $(cat "$(pidfile slurmctld)")" || echo DEAD)"
  if [ "$(mode)" = multi ]; then
    for k in $(seq 1 "$n"); do
      local h="?"; alive "holder-node$k" && h="$(in_node "node$k" hostname)"
      printf '  node%-6s hostname=%s eth0=%s eth1=%s slurmd=%s sshd=%s\n' "$k" "$h" "$MGMT_NET.$k" "$FAB_NET.$k" \
        "$(alive "slurmd-node$k" && cat "$(pidfile "slurmd-node$k")" || echo DEAD)" \
        "$(alive "sshd-node$k" && cat "$(pidfile "sshd-node$k")" || echo DEAD)"
    done
  fi
  sinfo -N -o '  %N %t %c CPUs' 2>/dev/null || echo "  sinfo: controller not answering"
}

case "${1:-up}" in
  up) shift || true; up "$@" ;;
  down) down ;;
  status) status ;;
  exec)
    if [ $# -lt 3 ] || [ "$3" != "--" ]; then die "usage: $0 exec NODE -- CMD..."; fi
    node="$2"; shift 3
    in_node "$node" "$@" ;;
  kill-node) kill_node "${2:-}" ;;
  ray-up) ray_up ;;
  ray-down) ray_down ;;
  link) link "${2:-}" ;;
  revive) revive_node "${2:-}" ;;
  pids)
    [ $# -eq 2 ] || die "usage: $0 pids NODE"
    ip netns pids "hvk-$2" ;;
  *) echo "usage: $0 up [--nodes N] [--link RATE[,DELAY]] | link RATE[,DELAY]|off | status | exec NODE -- CMD | pids NODE | kill-node NODE | revive NODE | ray-up | ray-down | down" >&2; exit 2 ;;
esac
