#!/usr/bin/env bash
# PPO on a Llama-3-70B-class model: 8 nodes × 8 GPUs.
#
#   sbatch scripts/slurm/ppo_70b.sh [CONFIG.yaml] [key=value ...]    (from the repository root)
#   bash scripts/slurm/ppo_70b.sh --dry-run [key=value ...]           (layout + memory, no Slurm)
#
# Layout (configs/ppo_llama3_70b.yaml): training TP=8 × PP=4 × DP=2, generation TP_g=8 × DP_g=8;
# actor, critic and reference colocated on all 64 GPUs. From `--dry-run` (planner estimates per
# GPU, 80 GiB GPUs; fits when <= 73.6 GiB):
#   TP=8           one TP group per node (ranks 8k..8k+7): tensor-parallel all-reduces stay on NVLink.
#   PP=4, DP=2     node pairs form a pipeline stage: nodes 0-1 stage 0, ..., nodes 6-7 stage 3.
#   actor_update   46.6 GiB (params 4.2, fp32 grads 8.5, distributed Adam 12.7, activations 10.7
#                  for 8192-token micro-batches with recompute, reference + critic params 8.5)
#   generate       34.4 GiB (TP_g=8 weight copy 16.4, KV cache 2.5 for 32 sequences × 2048 tokens)
#   host           338 GiB pinned per node (offloaded grads + optimizer states of actor and critic)
#   Alternatives:  PP=1 needs ~108 GiB even with recompute; PP=2 66 GiB (within the estimate's
#                  error of the limit). With TransformerEngine: sequence parallelism and no
#                  recompute fit at PP=4 (61 GiB) and update ~1/3 faster (see the config).
#
#SBATCH --job-name=ppo_70b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
# The warning signal must leave time for one PPO step plus one checkpoint save: the trainer only
# stops at a step boundary.
#SBATCH --signal=B:USR1@1200
#SBATCH --requeue
set -euo pipefail
VERL_MCORE_ROOT=${VERL_MCORE_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}}
export VERL_MCORE_ROOT DEFAULT_CONFIG=configs/ppo_llama3_70b.yaml
exec bash "$VERL_MCORE_ROOT/scripts/slurm/launch.sh" "${BASH_SOURCE[0]}" "$@"
