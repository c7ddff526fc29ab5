#!/usr/bin/env bash
# A throw-away one-node Slurm cluster on this machine, for tests (Debian 12, root, no systemd).
#
#   tests/hpc/local_slurm.sh install          apt-get the daemons if missing (slurmctld slurmd
#                                             slurm-client munge, ~8 packages)
#   tests/hpc/local_slurm.sh start DIR        write DIR/slurm.conf, start munged, slurmctld and
#                                             slurmd with every file under DIR; prints the line
#                                             `export SLURM_CONF=DIR/slurm.conf` to use the cluster
#   tests/hpc/local_slurm.sh stop DIR         stop those daemons by the PIDs recorded in DIR
#
# Ports are taken from SLURMCTLD_PORT / SLURMD_PORT (default 6817 / 6818) so that several
# clusters can coexist. munged runs on its own socket under DIR (--force: it refuses root
# otherwise). Settings that matter here (found in a trial on these machines):
#   ProctrackType=proctrack/pgid   linuxproc leaves orphans of a batch script that exits early
#   TaskPlugin=task/none, JobAcctGatherType=jobacct_gather/none: no cgroups in the container
#   AuthInfo=cred_expire=10 + SchedulerParameters=sched_interval=2,bf_interval=1: a requeued
#                                  job starts again after ~10 s instead of ~150 s
#   ReturnToService=2              the node comes back by itself after slurmd restarts
# Jobs asking for more tasks than CPUs need `--overcommit` (otherwise they queue forever).
set -euo pipefail

cmd=${1:?usage: local_slurm.sh install | start DIR | stop DIR}

install() {
  if command -v slurmctld > /dev/null && command -v slurmd > /dev/null && command -v sbatch > /dev/null &&
    command -v munged > /dev/null; then
    return 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge > /dev/null
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2
  shift 2
  local deadline=$((SECONDS + limit))
  until "$@" > /dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      echo "local_slurm: $what did not come up within ${limit}s" >&2
      return 1
    fi
    sleep 0.2
  done
}

start() {
  local dir=$1
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  dir=$(cd "$dir" && pwd)
  local cpus
  cpus=$(nproc)
  local ctld_port=${SLURMCTLD_PORT:-6817} slurmd_port=${SLURMD_PORT:-6818}

  mkdir -p /run/munge
  munged --force --socket="$dir/munge.socket" --pid-file="$dir/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge.seed" --key-file=/etc/munge/munge.key
  wait_for 10 munged test -S "$dir/munge.socket"

  cat > "$dir/slurm.conf" << EOF
ClusterName=verltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.socket,cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
SchedulerParameters=sched_interval=2,bf_interval=1
KillWait=10
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$dir/slurm.conf
  # -D: stay in the foreground so that $! is the daemon's PID (stop kills exactly that).
  slurmctld -D -i -f "$SLURM_CONF" > "$dir/log/slurmctld.out" 2>&1 &
  echo $! > "$dir/slurmctld.daemon.pid"
  slurmd -D -f "$SLURM_CONF" > "$dir/log/slurmd.out" 2>&1 &
  echo $! > "$dir/slurmd.daemon.pid"
  if ! wait_for 30 "the node" bash -c "sinfo -h -N -o %T | grep -Eq '^(idle|mixed|allocated)'"; then
    tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
    return 1
  fi
  echo "export SLURM_CONF=$SLURM_CONF"
}

stop() {
  local dir=$1 pidfile pid
  # Jobs first, while slurmctld still runs: a step whose slurmd is gone would outlive the cluster.
  if [[ -f $dir/slurmctld.daemon.pid ]] && kill -0 "$(cat "$dir/slurmctld.daemon.pid")" 2> /dev/null; then
    export SLURM_CONF=$dir/slurm.conf
    scancel --quiet --full --user=root 2> /dev/null || true
    local deadline=$((SECONDS + 30))
    while [[ -n $(squeue -h -o %i 2> /dev/null) ]] && ((SECONDS < deadline)); do
      sleep 0.5
    done
  fi
  for pidfile in "$dir/slurmd.daemon.pid" "$dir/slurmctld.daemon.pid" "$dir/munged.pid"; do
    [[ -f $pidfile ]] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2> /dev/null || true
    for _ in $(seq 50); do
      kill -0 "$pid" 2> /dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2> /dev/null || true
    rm -f "$pidfile"
  done
}

case $cmd in
  install) install ;;
  start) start "${2:?start DIR}" ;;
  stop) stop "${2:?stop DIR}" ;;
  *)
    echo "usage: local_slurm.sh install | start DIR | stop DIR" >&2
    exit 2
    ;;
esac
