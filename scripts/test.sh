#!/usr/bin/env bash
# From a fresh clone to the tests in one command: set up the environment (scripts/setup.sh:
# .venv with the right torch and verl_mcore with its test extras, skipped when already there),
# then run pytest. Without arguments: the CI tier, `-q -m "not slow" tests` (about 8 minutes on
# 2 cores); arguments go to pytest instead (e.g. `tests/reward -x`, or `-q tests` for everything).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
"$ROOT/scripts/setup.sh"
# shellcheck source=/dev/null  # the environment setup.sh made
. "${VERL_MCORE_VENV:-$ROOT/.venv}/bin/activate"
cd "$ROOT"
if [ $# -eq 0 ]; then set -- -q -m "not slow" tests; fi
exec python -m pytest "$@"
