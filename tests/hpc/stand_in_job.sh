#!/usr/bin/env bash
# The Slurm tests' recipe: the header of scripts/slurm/*.sh scaled to one CPU node with 2 tasks
# and no GPUs, running the same launcher. VERL_MCORE_MODULE (exported by the test) selects the
# program: tests.hpc.fake_train until the trainer exists.
#
#SBATCH --job-name=stand_in
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --overcommit
#SBATCH --time=00:10:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@30
#SBATCH --requeue
set -euo pipefail
: "${VERL_MCORE_ROOT:?export VERL_MCORE_ROOT (the repository root)}"
exec bash "$VERL_MCORE_ROOT/scripts/slurm/launch.sh" "${BASH_SOURCE[0]}" "$@"
