#!/usr/bin/env bash
# From a fresh clone to the quickstart in one command: set up the environment (scripts/setup.sh:
# .venv with the right torch and verl_mcore, skipped when already there), then run
#   python -m verl_mcore.train --config configs/quickstart.yaml [key=value ...]
# Arguments are config overrides (e.g. trainer.device=cuda). Run again, it resumes the run.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
"$ROOT/scripts/setup.sh"
# shellcheck source=/dev/null  # the environment setup.sh made
. "${VERL_MCORE_VENV:-$ROOT/.venv}/bin/activate"
cd "$ROOT"
exec python -m verl_mcore.train --config configs/quickstart.yaml "$@"
