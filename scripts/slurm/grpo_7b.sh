#!/usr/bin/env bash
# GRPO on Qwen2.5-7B-Instruct with GSM8K, one node of 8 GPUs.
#
#   sbatch scripts/slurm/grpo_7b.sh [CONFIG.yaml] [key=value ...]     (from the repository root)
#   bash scripts/slurm/grpo_7b.sh --dry-run [key=value ...]            (layout + memory, no Slurm)
#
# Layout (configs/grpo_qwen2.5_7b_gsm8k.yaml): training TP=2 × DP=4, generation TP_g=2 × DP_g=4,
# reference colocated. Planner, 80 GiB GPUs: actor_update 54.2 GiB with 4096-token micro-batches
# (8192 would need ~67), generate 27.8.
#
#SBATCH --job-name=grpo_7b
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
export VERL_MCORE_ROOT DEFAULT_CONFIG=configs/grpo_qwen2.5_7b_gsm8k.yaml
exec bash "$VERL_MCORE_ROOT/scripts/slurm/launch.sh" "${BASH_SOURCE[0]}" "$@"
