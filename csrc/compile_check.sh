#!/usr/bin/env bash
# CI on CPU machines: compile every csrc/*.cu with nvcc for sm_80 and sm_90 (object code, so ptxas
# runs too), and syntax-check the torch binding (csrc/*.cpp) against the installed torch headers,
# which the binding keeps device-generic for this reason. Fails on any error or compiler warning.
# Jobs run in parallel; ~30-60 s on 2 cores.
set -euo pipefail
cd "$(dirname "$0")"

NVCC="${NVCC:-$(command -v nvcc || true)}"
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -z "$NVCC" ]; then
  echo "compile_check: nvcc not found (set NVCC=/path/to/nvcc); cannot check csrc/" >&2
  exit 1
fi
CUDA_INC=""
for d in "${CUDA_HOME:-}" "$(dirname "$(dirname "$(readlink -f "$NVCC")")")" /usr/local/cuda; do
  if [ -n "$d" ] && [ -f "$d/include/cuda_runtime.h" ]; then CUDA_INC="$d/include"; break; fi
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
pids=()
names=()

for cu in *.cu; do
  "$NVCC" -c -std=c++17 -O3 --use_fast_math -Werror all-warnings \
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
    -o "$tmp/${cu%.cu}.o" "$cu" >"$tmp/${cu}.log" 2>&1 &
  pids+=($!)
  names+=("$cu")
done

PY="${PYTHON:-python3}"
if [ -z "$CUDA_INC" ]; then
  echo "compile_check: cuda_runtime.h not found (set CUDA_HOME); skipping the binding's syntax check"
elif TORCH_INC="$("$PY" -c 'import torch.utils.cpp_extension as c; print(" ".join("-I" + p for p in c.include_paths()))' 2>/dev/null)"; then
  PY_INC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  for cpp in *.cpp; do
    # shellcheck disable=SC2086  # TORCH_INC is a list of -I flags
    g++ -std=c++20 -fsyntax-only -Wall -Werror -DTORCH_EXTENSION_NAME=_C $TORCH_INC -I"$PY_INC" -I"$CUDA_INC" \
      "$cpp" >"$tmp/${cpp}.log" 2>&1 &
    pids+=($!)
    names+=("$cpp")
  done
else
  echo "compile_check: torch not importable with $PY; skipping the binding's syntax check"
fi

status=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then
    echo "compile_check: ok   ${names[$i]}"
  else
    echo "compile_check: FAIL ${names[$i]}" >&2
    cat "$tmp/${names[$i]}.log" >&2
    status=1
  fi
done
exit $status
