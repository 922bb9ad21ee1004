#!/usr/bin/env bash
# A throwaway two-node Slurm cluster on this one machine, to try slurm/*.sbatch (and to test them) without a
# cluster: the real slurmctld and two real slurmd (nodes n1 and n2, both this machine), Debian's packages.
#
#   sudo bash scripts/slurm_cluster.sh install     # apt-get install the pinned Slurm + munge (root, ~10 s)
#   bash scripts/slurm_cluster.sh start DIR         # config, keys, logs and spool in DIR; prints the SLURM_CONF line
#   export SLURM_CONF=DIR/slurm.conf; sbatch ...   # then submit as on a cluster
#   bash scripts/slurm_cluster.sh stop DIR
#
# Start needs root (slurmd runs jobs as their user) and ports 6817-6819 free: one such cluster per machine.
set -euo pipefail

SLURM_VERSION=22.05.8-4+deb12u3  # Debian 12 (bookworm); what docs/cluster.md was tested with
MUNGE_VERSION=0.5.15-2+deb12u1
CPUS=${SLURM_NODE_CPUS:-4}        # CPUs each simulated node declares (the machine may have fewer)

die() { echo "error: $*" >&2; exit 1; }

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        echo "Slurm is installed: $(dpkg-query -W -f '${Version}' slurmd 2>/dev/null || echo "$(command -v slurmd)")"; return
    fi
    [ "$(id -u)" = 0 ] || die "installing Slurm needs root: sudo bash $0 install"
    command -v apt-get >/dev/null || die "no apt-get: install slurmd, slurmctld, slurm-client and munge with your package manager"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "slurmd=$SLURM_VERSION" "slurmctld=$SLURM_VERSION" "slurm-client=$SLURM_VERSION" \
        "slurm-wlm-basic-plugins=$SLURM_VERSION" "munge=$MUNGE_VERSION" "libmunge2=$MUNGE_VERSION" \
        >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmd slurmctld slurm-client munge >/dev/null  # another Debian release: its own versions
    echo "installed: Slurm $(dpkg-query -W -f '${Version}' slurmd)"
}

start() {
    local dir=$1
    [ "$(id -u)" = 0 ] || die "starting slurmd needs root"
    mkdir -p "$dir"/{spool,state,log}
    dir=$(cd "$dir" && pwd)
    chmod 755 "$dir"
    # munge: every Slurm message is signed with its key; its daemon runs as user munge, in a folder that user can
    # reach (DIR may sit below a folder only root may enter), on a socket of ours.
    local munge
    munge=$(mktemp -d /tmp/slurm-cluster-munge.XXXXXX)
    echo "$munge" > "$dir/munge-dir"
    mungekey -c -f -k "$munge/munge.key" 2>/dev/null || dd if=/dev/urandom of="$munge/munge.key" bs=1024 count=1 2>/dev/null
    chown -R munge:munge "$munge"
    chmod 400 "$munge/munge.key"
    chmod 711 "$munge"  # others may reach the socket (every job's srun uses it), not list or read the key
    sudo_munge() { if command -v runuser >/dev/null; then runuser -u munge -- "$@"; else su -s /bin/sh munge -c "$*"; fi; }
    sudo_munge munged --key-file="$munge/munge.key" --socket="$munge/socket" --pid-file="$munge/pid" \
        --log-file="$munge/log" --seed-file="$munge/seed" --force
    cat > "$dir/slurm.conf" <<EOF
# Written by scripts/slurm_cluster.sh: two nodes (n1, n2) that are both this machine.
ClusterName=local
SlurmctldHost=localhost
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again after this many seconds (+1); the default 120 suits real clusters.
AuthInfo=socket=$munge/socket,cred_expire=10
SlurmUser=root
SlurmctldPort=6817
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# sched_interval=1: a requeued job starts as soon as it may, not at the next scheduling pass (every 60 s,
# backfill's every 30 s: up to 40 s of waiting in tests/test_slurm.py's requeue).
SchedulerParameters=batch_sched_delay=0,sched_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=4
KillWait=30
JobRequeue=1
MailProg=/bin/true
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=6818 Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=6819 Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -c -f "$SLURM_CONF"  # -c: no state of an earlier cluster
    for node in n1 n2; do
        mkdir -p "$dir/spool/$node"
        slurmd -N "$node" -f "$SLURM_CONF"
    done
    for _ in $(seq 100); do  # both nodes idle: ready for jobs
        if [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = 2 ]; then
            echo "export SLURM_CONF=$SLURM_CONF"; return
        fi
        sleep 0.1
    done
    sinfo -N >&2 || true
    die "the nodes did not come up; see $dir/log/"
}

stop() {
    local dir
    dir=$(cd "$1" && pwd)
    SLURM_CONF=$dir/slurm.conf scontrol shutdown >/dev/null 2>&1 || true
    for pidfile in "$dir"/slurmctld.pid "$dir"/slurmd-*.pid; do
        [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    local munge
    munge=$(cat "$dir/munge-dir" 2>/dev/null || true)
    if [ -n "$munge" ]; then
        [ -f "$munge/pid" ] && kill "$(cat "$munge/pid")" 2>/dev/null || true
        pkill -f "munged .*--socket=$munge/socket" 2>/dev/null || true  # also one whose pid file was not written yet
        sleep 0.2
        rm -rf "$munge"
    fi
    for _ in $(seq 50); do  # the ports are free again
        pgrep -f "slurm(ctld|d) .*-f $dir/slurm.conf" >/dev/null || return 0
        sleep 0.1
    done
    pkill -9 -f "slurm(ctld|d) .*-f $dir/slurm.conf" || true
}

case "${1:-}" in
    install) install ;;
    start) [ $# = 2 ] || die "usage: $0 start DIR"; start "$2" ;;
    stop) [ $# = 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
    *) die "usage: $0 install | start DIR | stop DIR" ;;
esac
