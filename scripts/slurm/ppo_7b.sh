#!/usr/bin/env bash
# PPO (critic + GAE) on Qwen2.5-7B, one node of 8 GPUs.
#
#   sbatch scripts/slurm/ppo_7b.sh [CONFIG.yaml] [key=value ...]      (from the repository root)
#   bash scripts/slurm/ppo_7b.sh --dry-run [key=value ...]             (layout + memory, no Slurm)
#
# Layout (configs/ppo_7b.yaml): training TP=4 × DP=2, generation TP_g=2 × DP_g=4.
# Planner, 80 GiB GPUs: actor_update 46.4 GiB, critic_update 43.9, generate 22.1.
#
#SBATCH --job-name=ppo_7b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
# Time for one step plus one checkpoint save before the time limit.
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
set -euo pipefail
VERL_MCORE_ROOT=${VERL_MCORE_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}}
export VERL_MCORE_ROOT DEFAULT_CONFIG=configs/ppo_7b.yaml
exec bash "$VERL_MCORE_ROOT/scripts/slurm/launch.sh" "${BASH_SOURCE[0]}" "$@"
