#!/usr/bin/env bash
# The GPU matrix on the device machine (one H200): the trainer on CUDA for a few steps in every
# configuration a user can choose. The cases, checks and report are in bench/gpu_matrix.py.
#
#   [COMMIT=sha] bash bench/gpu_matrix.sh [--cases PATTERN] [--jobs N] [...]   (carry: .whl with
#                                          the cp312 megatron-core wheel)
#
# Installs the carried wheels, builds the CUDA extension, makes the tiny model, then runs the
# driver with what is left of the 10-minute device call (MATRIX_LIMIT_S, default 600) less a
# margin for the report: cases it cannot start in time are reported as not run. $OUT gets
# gpu_matrix.md (the bench/RESULTS.md entry), gpu_matrix.json, gpu_matrix_logs.tar.gz and
# build.log. Exit status: the driver's (non-zero when a case failed or did not run).
set -uo pipefail
OUT=${OUT:-/tmp/out}
# shellcheck source=SCRIPTDIR/device_setup.sh
. bench/device_setup.sh  # wheels, PYTHONPATH, the CUDA extension (the cases run without it too)
model=/tmp/gpu_matrix_model
python3 -m tools.make_tiny_model --out "$model" || exit 1
budget=$(( ${MATRIX_LIMIT_S:-600} - SECONDS - 30 ))
echo "=== matrix: ${budget} s for the cases"
python3 bench/gpu_matrix.py --device cuda --model "$model" --work /tmp/gpu_matrix --out "$OUT" \
  --budget-s "$budget" --command "bash bench/gpu_matrix.sh $*" "$@"
