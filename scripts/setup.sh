#!/usr/bin/env bash
# Set up a checkout to run: a virtual environment with torch and verl_mcore (editable, with the
# test extras). scripts/quickstart.sh and scripts/test.sh run this first; run it alone to set up
# without running anything.
#
#   scripts/setup.sh [--dry-run]      (--dry-run: say what it would do, change nothing)
#
# Idempotent: a second run reuses the environment and skips what is already installed (a few
# seconds). Which torch:
#   - one already in the environment is kept, whatever its build;
#   - with an NVIDIA GPU (nvidia-smi lists one): a CUDA build of torch that the base Python
#     already has (a site or image install) is kept: the environment reads the base Python's
#     packages from where they are; without one, the default build from the package index (CUDA
#     on Linux);
#   - without a GPU: the CPU build, torch==2.13.0+cpu, from the configured package sources if
#     they have it (a local mirror), else from PyTorch's CPU index. A plain `pip install torch`
#     would fetch the multi-GB CUDA build there.
#
# Environment (all optional):
#   PYTHON              the base Python, 3.10 or newer (default python3)
#   VERL_MCORE_VENV     where the environment goes (default .venv in the checkout)
#   VERL_MCORE_EXTRAS   extras to install (default test; e.g. test,track)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VERL_MCORE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${VERL_MCORE_EXTRAS:-test}"
readonly CPU_TORCH="torch==2.13.0+cpu"
readonly CPU_INDEX="https://download.pytorch.org/whl/cpu"
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
if [ $# -gt 0 ]; then
  echo "setup: unknown argument $1 (usage: scripts/setup.sh [--dry-run])" >&2
  exit 2
fi

say() { echo "setup: $*"; }
run() {
  if [ "$DRY_RUN" = 1 ]; then echo "setup: would run: $*"; else "$@"; fi
}

has_gpu() { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }

# 1. the environment
torch_site=""
venv_clear=""
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c '' 2>/dev/null; then
  say "environment $VENV exists: reused"
else
  if [ -f "$VENV/pyvenv.cfg" ]; then
    # A venv whose python no longer runs (the base Python it was made from was upgraded or
    # removed): `python -m venv` over it keeps the dangling links, so it is made anew.
    say "environment $VENV is broken (its python does not run): made anew"
    venv_clear="--clear"
  fi
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "setup: $PYTHON is not Python 3.10 or newer; set PYTHON=/path/to/python3.11" >&2
    exit 1
  fi
  say "making the environment $VENV"
  # A CUDA torch the base Python has (a site or image install, often in a venv of its own) was
  # built for this machine's driver: the environment reads it from where it is, through a .pth
  # file (packages installed in the environment come first; --system-site-packages would miss
  # a base Python that is itself a venv).
  if has_gpu; then
    torch_site="$("$PYTHON" -c 'import os, torch; assert torch.version.cuda; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)" || torch_site=""
  fi
  run "$PYTHON" -m venv $venv_clear "$VENV"  # unquoted: empty is no argument
  if [ -n "$torch_site" ]; then
    say "the base Python has a CUDA build of torch in $torch_site: the environment reads it there"
    if [ "$DRY_RUN" = 0 ]; then
      site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
      echo "$torch_site" > "$site/verl_mcore_base_torch.pth"
    fi
  fi
fi
PY="$VENV/bin/python"

# 2. torch
if [ -x "$PY" ] && torch_version="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"; then
  say "torch $torch_version is installed: kept"
elif [ "$DRY_RUN" = 1 ] && [ -n "$torch_site" ]; then
  say "the base Python's CUDA torch would be kept"
elif has_gpu; then
  say "an NVIDIA GPU is present: installing the default (CUDA) build of torch"
  run "$PY" -m pip install torch
else
  say "no NVIDIA GPU: installing the CPU build of torch ($CPU_TORCH)"
  # The configured sources first (quiet: on plain PyPI it is simply not there), then PyTorch's
  # CPU index. The +cpu local version matches only a CPU build, never PyPI's CUDA one.
  if [ "$DRY_RUN" = 1 ]; then
    say "would run: $PY -m pip install $CPU_TORCH, and where the configured package sources" \
        "lack it, the same with --index-url $CPU_INDEX"
  elif ! "$PY" -m pip install -q "$CPU_TORCH" 2>/dev/null; then
    say "not in the configured package sources: from $CPU_INDEX"
    "$PY" -m pip install "$CPU_TORCH" --index-url "$CPU_INDEX"
  fi
fi

# 3. verl_mcore, editable, with its dependencies; skipped when this checkout's setup.py and
# pyproject.toml are what the last install used and the package imports.
stamp="$VENV/.verl_mcore_installed"
imports=0
want="$(cat "$ROOT/setup.py" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1) $ROOT [$EXTRAS]"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
    && "$PY" -c 'import verl_mcore, megatron.core' 2>/dev/null; then
  say "verl_mcore [$EXTRAS] is installed from $ROOT: kept"
  imports=1
else
  say "installing verl_mcore [$EXTRAS] from $ROOT (editable; minutes the first time)"
  run "$PY" -m pip install -q -e "${ROOT}[${EXTRAS}]"
  if [ "$DRY_RUN" = 0 ]; then echo "$want" > "$stamp"; fi
fi
# 4. what the commands import, imported after an install: pip calls a damaged package (a torch
# without its __init__.py) installed and skips it, so a damaged environment said "ready".
if [ "$DRY_RUN" = 0 ] && [ "$imports" = 0 ] \
    && ! err="$("$PY" -c 'import torch, verl_mcore, megatron.core' 2>&1)"; then
  rm -f "$stamp"
  echo "setup: $VENV is set up but does not import: ${err##*$'\n'}" >&2
  echo "setup: a package there is damaged: remove the environment (rm -rf $VENV) and run" \
       "scripts/setup.sh again" >&2
  exit 1
fi
say "ready: . $VENV/bin/activate"
