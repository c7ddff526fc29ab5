#!/usr/bin/env bash
# Shared launcher for the sbatch recipes in this directory (ppo_70b.sh, ppo_7b.sh, grpo_7b.sh).
#
#   launch.sh RECIPE_FILE [CONFIG.yaml] [--dry-run] [key=value ...]
#
# The recipes `exec` this script from their batch shell, so it is the process Slurm signals.
# What it does, in order:
#   1. plan: `python -m verl_mcore.plan` checks the config against this allocation (divisibility,
#      per-GPU memory) in seconds, before any model is loaded; a bad layout fails here.
#      --dry-run stops after this step and needs no Slurm: it reads the recipe's #SBATCH header
#      for the node and GPU counts.
#   2. launch one task per GPU with srun (default), or one torchrun per node
#      (VERL_MCORE_LAUNCHER=torchrun), running `python -m $VERL_MCORE_MODULE --config ... k=v ...`.
#   3. on SIGUSR1/SIGTERM to this shell (Slurm's pre-timeout warning from
#      `#SBATCH --signal=B:USR1@N`, or `scancel --signal=USR1 --batch`), create the stop-request
#      file $VERL_MCORE_STOP_REQUEST and keep waiting; the trainer's PreemptionGuard sees it at
#      the next step boundary, writes a checkpoint and exits with EXIT_PREEMPTED (75). The signal
#      is not forwarded: Slurm would deliver it to every process of the step, and the trainer's
#      helper processes (reward workers, checkpoint writers) die of a SIGUSR1.
#   4. on 75 (or the marker file rank 0 writes with it), `scontrol requeue` the job; the rerun
#      resumes from the newest checkpoint (checkpoint.resume=auto). Exit 86 means the collective
#      watchdog fired: not requeued, the log's WATCHDOG lines say where each rank was.
#
# Environment (all optional):
#   VERL_MCORE_MODULE       python module to run on every rank (default verl_mcore.train)
#   VERL_MCORE_LAUNCHER     srun (default: one task per GPU) | torchrun (one agent per node)
#   VERL_MCORE_ROOT         repository checkout (default: the sbatch submit directory)
#   VERL_MCORE_SKIP_PLAN=1  skip step 1 (a model the planner cannot read)
#   VERL_MCORE_MAX_RESTARTS requeue at most this many times (default 20)
#   PLAN_GPU_MEMORY_GB      GiB per GPU for the planner (default: nvidia-smi, else 80)
#   PLAN_NODES, PLAN_GPUS_PER_NODE  --dry-run only: plan for another allocation than the header's
#   PLAN_ARGS               extra planner options, e.g. "--no-offload --host-memory-gb 1000"
#   PYTHON                  interpreter (default python)
set -euo pipefail

# Exit codes shared with the Python side (verl_mcore/distributed/preemption.py, watchdog.py).
readonly EXIT_PREEMPTED=75
readonly EXIT_COLLECTIVE_TIMEOUT=86

# >>> SITE KNOBS: network settings that depend on your cluster. Leave empty to let NCCL
# autodetect; set them here or export them before `sbatch` (sbatch passes the environment on).
#   NCCL_IB_HCA         InfiniBand adapters NCCL may use, e.g. mlx5_0,mlx5_1 (see `ibstat`,
#                       `ls /sys/class/infiniband`); a leading ^ excludes instead.
#   NCCL_SOCKET_IFNAME  interface for NCCL's bootstrap / socket transport, e.g. ib0 or ^lo,docker
#   GLOO_SOCKET_IFNAME  the same for gloo (CPU collectives), usually the same value
#   NCCL_IB_GID_INDEX   RoCE only: the GID index your fabric uses (often 3)
NCCL_IB_HCA=${NCCL_IB_HCA:-}
NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-}
GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-}
NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-}
# <<< SITE KNOBS
for knob in NCCL_IB_HCA NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_GID_INDEX; do
  if [[ -n ${!knob} ]]; then export "${knob?}"; else unset "$knob"; fi
done

log() { echo "[launch $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 2; }

recipe=${1:?usage: launch.sh RECIPE_FILE [CONFIG.yaml] [--dry-run] [key=value ...]}
shift
config=""
dry_run=0
overrides=()
for arg in "$@"; do
  case $arg in
    --dry-run) dry_run=1 ;;
    *.yaml | *.yml)
      if [[ -z $config && $arg != *=* ]]; then config=$arg; else overrides+=("$arg"); fi ;;
    *=*) overrides+=("$arg") ;;
    *) die "unexpected argument '$arg': give a config .yaml, --dry-run or key=value overrides" ;;
  esac
done
config=${config:-${DEFAULT_CONFIG:-}}
[[ -n $config ]] || die "no config: pass CONFIG.yaml or set DEFAULT_CONFIG in the recipe"

module=${VERL_MCORE_MODULE:-verl_mcore.train}
launcher=${VERL_MCORE_LAUNCHER:-srun}
python=${PYTHON:-python}
root=${VERL_MCORE_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}
[[ -f $root/verl_mcore/plan.py ]] ||
  die "$root is not a verl_mcore checkout: submit from the repository root or set VERL_MCORE_ROOT"
cd "$root"
[[ -f $config ]] || die "config file '$config' not found (relative paths are from $root)"

# Allocation: Slurm's environment inside a job, the recipe's #SBATCH header for --dry-run.
sbatch_value() {  # sbatch_value FILE OPTION -> the value of "#SBATCH --OPTION=VALUE"
  sed -n "s/^#SBATCH --$2=\([0-9]*\).*/\1/p" "$1" | head -n 1
}
if [[ -n ${SLURM_JOB_ID:-} && $dry_run == 0 ]]; then
  nodes=${SLURM_JOB_NUM_NODES:?}
  gpus_per_node=${SLURM_NTASKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
  gpus_per_node=${gpus_per_node%%(*}
  [[ -n $gpus_per_node ]] || die "set #SBATCH --ntasks-per-node (one task per GPU)"
else
  nodes=${PLAN_NODES:-$(sbatch_value "$recipe" nodes)}
  gpus_per_node=${PLAN_GPUS_PER_NODE:-$(sbatch_value "$recipe" ntasks-per-node)}
  [[ -n $nodes && -n $gpus_per_node ]] ||
    die "$recipe has no '#SBATCH --nodes=N' / '#SBATCH --ntasks-per-node=G' lines"
fi
world=$((nodes * gpus_per_node))

if [[ -z ${PLAN_GPU_MEMORY_GB:-} ]] && command -v nvidia-smi > /dev/null 2>&1; then
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | head -n 1 || true)
  [[ $mib =~ ^[0-9]+$ ]] && PLAN_GPU_MEMORY_GB=$((mib / 1024))
fi
gpu_mem=${PLAN_GPU_MEMORY_GB:-80}

log "config $config; ${nodes} node(s) × ${gpus_per_node} rank(s) = ${world}; module $module; launcher $launcher"
log "job ${SLURM_JOB_ID:-none}, restart count ${SLURM_RESTART_COUNT:-0}"

# 1. Plan (seconds; no GPU work).
if [[ ${VERL_MCORE_SKIP_PLAN:-0} != 1 ]]; then
  plan_rc=0
  read -r -a plan_args <<< "${PLAN_ARGS:-}"
  "$python" -m verl_mcore.plan --config "$config" --nodes "$nodes" --gpus-per-node "$gpus_per_node" \
    --gpu-memory-gb "$gpu_mem" "${plan_args[@]}" "${overrides[@]}" || plan_rc=$?
  if ((plan_rc != 0)); then
    log "the planner rejected this config for this allocation (exit $plan_rc); nothing was launched"
    exit "$plan_rc"
  fi
fi

# Since Slurm 22.05 srun no longer inherits the batch script's --cpus-per-task: pass it on, or
# every rank would be confined to one core (data loading, reward workers).
cpus=${SLURM_CPUS_PER_TASK:-}
if [[ $launcher == srun ]]; then
  cmd=(srun --ntasks="$world" --ntasks-per-node="$gpus_per_node" --kill-on-bad-exit=1
    ${cpus:+--cpus-per-task="$cpus"}
    "$python" -u -m "$module" --config "$config" "${overrides[@]}")
elif [[ $launcher == torchrun ]]; then
  # One agent per node (rendezvous on the first node).
  head_node=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" 2> /dev/null | head -n 1 || echo localhost)
  port=$((20000 + ${SLURM_JOB_ID:-0} % 20000))
  cmd=(srun --ntasks="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=1
    ${cpus:+--cpus-per-task="$((cpus * gpus_per_node))"}
    "$python" -m torch.distributed.run --nnodes="$nodes" --nproc-per-node="$gpus_per_node"
    --rdzv-backend=c10d --rdzv-endpoint="$head_node:$port" --rdzv-id="${SLURM_JOB_ID:-0}"
    -m "$module" --config "$config" "${overrides[@]}")
else
  die "VERL_MCORE_LAUNCHER=$launcher: use srun or torchrun"
fi

if ((dry_run)); then
  log "dry run: would run: ${cmd[*]}"
  exit 0
fi
[[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a Slurm job: submit with sbatch (or use --dry-run)"

# Both files live on this (the first) node, where rank 0 runs. Rank 0 writes the marker when it
# exits with EXIT_PREEMPTED after a complete checkpoint: the exit code alone does not survive
# torchrun, or srun terminating the other ranks of the step once the first one has exited.
tag="${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}"
marker="${TMPDIR:-/tmp}/verl_mcore_preempted.$tag"
request="${TMPDIR:-/tmp}/verl_mcore_stop_request.$tag"
rm -f "$marker" "$request"
export VERL_MCORE_PREEMPT_MARKER=$marker VERL_MCORE_STOP_REQUEST=$request PYTHONUNBUFFERED=1

# 3. Signals: Slurm sends --signal=B:USR1 to this shell only.
interrupted=0
# shellcheck disable=SC2317  # invoked by the traps below
request_stop() {
  interrupted=1
  log "received SIG$1: asking the trainer to checkpoint and stop at its next step boundary ($request)"
  touch "$request"
}
trap 'request_stop USR1' USR1
trap 'request_stop TERM' TERM

# 2. Launch in the background and wait: bash runs traps only between commands, and `wait` is
# interruptible where a foreground srun is not.
"${cmd[@]}" &
step_pid=$!
while :; do
  rc=0
  wait "$step_pid" || rc=$?
  # A trapped signal makes `wait` return 128+N while the step still runs: wait again.
  if ((interrupted && rc > 128)); then
    interrupted=0
    continue
  fi
  break
done
log "job step exited with $rc"
rm -f "$request"

# 4. Requeue on preemption.
if ((rc == EXIT_PREEMPTED)) || [[ -s $marker ]]; then
  restarts=${SLURM_RESTART_COUNT:-0}
  max=${VERL_MCORE_MAX_RESTARTS:-20}
  log "preempted after a complete checkpoint (step $(cat "$marker" 2> /dev/null || echo '?'))"
  rm -f "$marker"
  if ((restarts >= max)); then
    log "not requeueing: SLURM_RESTART_COUNT=$restarts reached VERL_MCORE_MAX_RESTARTS=$max"
    exit "$EXIT_PREEMPTED"
  fi
  log "scontrol requeue $SLURM_JOB_ID (restart $((restarts + 1)))"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
if ((rc == EXIT_COLLECTIVE_TIMEOUT)); then
  log "a collective timed out (trainer.collective_timeout_s): each rank's WATCHDOG line names its phase, operation and step"
elif ((rc != 0)); then
  # srun reports 143 once it has terminated the remaining ranks after the first failure.
  log "the job step failed: the first failing rank's error, and WATCHDOG / SIGNAL lines with each rank's phase, are above"
fi
exit "$rc"
