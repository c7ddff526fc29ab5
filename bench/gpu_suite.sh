#!/usr/bin/env bash
# One call on a GPU machine (the device tool's H200): install the carried megatron-core wheel,
# build the CUDA extension, run the benchmarks and the GPU tests, logs under $OUT.
#   run: bash bench/gpu_suite.sh        (carry: .whl with the cp312 megatron-core wheel)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true
TORCH_CUDA_ARCH_LIST=9.0 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  && echo "extension built" || { echo "extension build FAILED"; tail -20 "$OUT/build.log"; }
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?"; grep -v -i "warn" "$OUT/$name.log" | tail -${TAIL:-30}
}
TAIL=25 run actor_1.5b 110 python3 bench/bench_actor.py --shape 1.5b --seq 4096 --samples 32
TAIL=12 run rollout 120 python3 bench/bench_rollout.py
TAIL=25 run actor_3b 100 python3 bench/bench_actor.py --shape 3b --seq 4096 --samples 32
[ "${FULL:-0}" = 1 ] || exit 0  # the rest: FULL=1 bash bench/gpu_suite.sh
TAIL=15 run quickstart_gpu 60 bash -c "python3 -m tools.make_tiny_model --out /tmp/tiny && \
  python3 -m verl_mcore.train --config configs/quickstart.yaml model.path=/tmp/tiny \
  trainer.device=cuda trainer.total_steps=20 trainer.val_every=10 trainer.run_dir=/tmp/qs"
TAIL=12 run gpu_tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests
