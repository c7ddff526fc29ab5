# shellcheck shell=bash
# Sourced from the repository root by bench/gpu_suite.sh and bench/gpu_matrix.sh on the device
# machine: install the carried wheels (.whl: the cp312 megatron-core wheel, and whatever else the
# caller needs) to /tmp/site, put them and this tree on PYTHONPATH, print the GPU, and build the
# CUDA extension in place (log: $OUT/build.log). A failed build is reported, not fatal: the ops
# fall back to their torch references and say so.
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD
# Once per command: a script that sources this from another that already did (bench/gpu_matrix.sh
# under bench/real_model_gpu.sh) must not reinstall /tmp/site under processes importing from it.
if [ -z "${VERL_MCORE_DEVICE_SETUP:-}" ]; then
  export VERL_MCORE_DEVICE_SETUP=1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  git rev-parse --short HEAD 2>/dev/null || true
  if MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    echo "extension built"
  else
    echo "extension build FAILED"; tail -20 "$OUT/build.log"
  fi
fi
