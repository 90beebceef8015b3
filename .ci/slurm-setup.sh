#!/usr/bin/env bash
# A real Slurm on this one host for CI: Debian's slurmctld + slurmd + munge, localhost only.
#
#   .ci/slurm-setup.sh                # as root: apt-get install if missing, configure, start, wait
#   .ci/slurm-setup.sh --no-install   # configure and start only; fail if Slurm is not installed
#   .ci/slurm-setup.sh --stop         # stop munged, slurmctld and the slurmd daemons
#
# Idempotent: a second run leaves a healthy cluster as it is (well under a second).
# The host plays two Slurm nodes, one slurmd each (slurmd -N NAME, own port and spool):
#   mh-a100 (Features=a100, partition a100) and mh-v100 (Features=v100, partition v100),
# both in the default partition "debug". So the launch scripts' per-GPU-type selection
# (heterogeneous job components by partition or --constraint) runs for real: each component
# lands on "its" node. Each node claims MH_SLURM_CPUS CPUs (default 4) whatever the host has
# (SlurmdParameters=config_overrides), so a 4-rank job fits on a 2-core CI machine.
set -euo pipefail

CPUS=${MH_SLURM_CPUS:-4}
NODES=(mh-a100:a100 mh-v100:v100)   # node:feature (= partition)
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
INSTALL=1
ACTION=start

for arg in "$@"; do
    case $arg in
        --no-install) INSTALL=0 ;;
        --stop) ACTION=stop ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "slurm-setup: unknown argument '$arg' (expected --no-install, --stop)" >&2; exit 2 ;;
    esac
done

die() { echo "slurm-setup: error: $*" >&2; exit 1; }
log() { echo "slurm-setup: $*"; }

[[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts daemons)"

running() { pgrep -x "$1" >/dev/null 2>&1; }

stop_daemon() {
    local name=$1 pid
    for pid in $(pgrep -x "$name" || true); do kill "$pid" 2>/dev/null || true; done
    for _ in $(seq 50); do running "$name" || return 0; sleep 0.1; done
    die "$name did not stop"
}

if [[ $ACTION == stop ]]; then
    stop_daemon slurmd; stop_daemon slurmctld; stop_daemon munged
    log "stopped"; exit 0
fi

# -- packages ---------------------------------------------------------------------------------
# The launch-script tests also run shellcheck (not Slurm): CI gets it here in the same step.
need=()
for bin in slurmctld slurmd munged sinfo sbatch shellcheck; do command -v "$bin" >/dev/null || need+=("$bin"); done
if ((${#need[@]})); then
    pkgs=(slurmctld slurmd slurm-client munge shellcheck)
    ((INSTALL)) || die "not installed: ${need[*]} (run without --no-install, or apt-get install ${pkgs[*]})"
    command -v apt-get >/dev/null || die "missing ${need[*]} and no apt-get to install them"
    log "installing ${pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 \
             && apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null; } \
        || die "apt-get install ${pkgs[*]} failed"
fi

# -- munge --------------------------------------------------------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
if ! running munged; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged || die "munged did not start (see /var/log/munge/munged.log)"
fi
for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n | unmunge >/dev/null || die "munge does not work (see /var/log/munge/munged.log)"

# -- slurm.conf -------------------------------------------------------------------------------
host=$(hostname)
mem_mb=$(awk -v n=${#NODES[@]} '/MemTotal/ {print int($2 / 1024 * 0.8 / n)}' /proc/meminfo)
install -d -m 0755 "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld
node_lines="" part_lines="" all_nodes="" port=17001
for entry in "${NODES[@]}"; do
    node=${entry%%:*} feature=${entry#*:}
    node_lines+="NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 Port=$port CPUs=$CPUS RealMemory=$mem_mb Features=$feature State=UNKNOWN"$'\n'
    part_lines+="PartitionName=$feature Nodes=$node MaxTime=30 State=UP"$'\n'
    all_nodes+=${all_nodes:+,}$node
    port=$((port + 1))
    install -d -m 0755 "/var/spool/slurmd/$node"
done
new_conf=$(cat <<EOF
# Written by megatron-hetero .ci/slurm-setup.sh: a single-host test cluster.
ClusterName=mhci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits for the credential lifetime before it runs again (120 s by default);
# a credential here is checked within a second or two of being made (slurmctld and slurmd
# share the host), so 10 s (Slurm's minimum is 5)
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
DefMemPerCPU=256
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
${node_lines}PartitionName=debug Nodes=$all_nodes Default=YES MaxTime=30 State=UP
${part_lines}
EOF
)
changed=0
if [[ ! -f $CONF ]] || [[ $(cat "$CONF") != "$new_conf" ]]; then
    log "writing $CONF (nodes $all_nodes on $host, $CPUS CPUs each)"
    printf '%s\n' "$new_conf" >"$CONF"
    changed=1
fi

# -- daemons ----------------------------------------------------------------------------------
slurmd_running() { pgrep -f "slurmd -N $1\$" >/dev/null 2>&1; }
if ((changed)); then
    running slurmd && stop_daemon slurmd
    running slurmctld && stop_daemon slurmctld
fi
if ! running slurmctld; then
    log "starting slurmctld"
    /usr/sbin/slurmctld || die "slurmctld did not start (see $LOG_DIR/slurmctld.log)"
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
scontrol ping | grep -q UP || die "slurmctld does not answer (see $LOG_DIR/slurmctld.log)"
for entry in "${NODES[@]}"; do
    node=${entry%%:*}
    if ! slurmd_running "$node"; then
        log "starting slurmd for node $node"
        /usr/sbin/slurmd -N "$node" || die "slurmd -N $node did not start (see $LOG_DIR/slurmd-$node.log)"
    fi
done

# -- wait for the nodes -----------------------------------------------------------------------
for entry in "${NODES[@]}"; do
    node=${entry%%:*} state=""
    for _ in $(seq 120); do
        state=$(sinfo -h -n "$node" -o '%T' 2>/dev/null | head -n1)
        case $state in
            idle|mixed|allocated|completing) break ;;
            down*|drain*) scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;;
        esac
        sleep 0.5
    done
    case $state in
        idle|mixed|allocated|completing) ;;
        *) die "node $node is '${state:-unknown}' after 60 s (reason: $(sinfo -h -R -n "$node" -o '%E' 2>/dev/null); see $LOG_DIR/slurmd-$node.log)" ;;
    esac
done
log "ready: $(sinfo -h -o '%P=%N:%T' | tr '\n' ' ')"
