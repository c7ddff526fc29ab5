#!/usr/bin/env bash
# The benchmark suite on one GPU machine (the device tool's H200): install the carried wheels,
# build the CUDA extension, run the chosen parts, logs and JSON under $OUT.
#
#   bash bench/gpu_suite.sh [PART...]     (carry: .whl with the cp312 megatron-core wheel, and
#                                          trl/datasets/dill/multiprocess wheels for the TRL part)
# PARTS: kernels, rollout, actor, grpo, trl, tests (GPU-marked tests), quickstart (trainer on
# CUDA), or `all` (the default). One device call allows 10 minutes: `rollout actor tests` and
# `grpo trl` each fit in one.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true
MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  && echo "extension built" || { echo "extension build FAILED"; tail -20 "$OUT/build.log"; }

run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?"; grep -v -i "warn" "$OUT/$name.log" | tail -"${TAIL:-30}"
}
want() { [[ " $PARTS " == *" $1 "* || " $PARTS " == *" all "* ]]; }
PARTS="${*:-all}"

if want tests; then
  TAIL=6 run gpu_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops tests/models tests/rollout
fi
if want kernels; then
  TAIL=45 run kernels 120 python3 bench/bench_kernels.py --results "$OUT/kernels.md"
fi
if want rollout; then
  TAIL=14 run rollout 150 python3 bench/bench_rollout.py --compare-unfused --repartition
  TAIL=6 run rollout_long 200 python3 bench/bench_rollout.py --batch 64 --prompt-len 1024 --new-tokens 1024
fi
if want actor; then
  TAIL=20 run actor_1.5b 110 python3 bench/bench_actor.py --shape 1.5b --seq 4096 --samples 32
  TAIL=20 run actor_3b 110 python3 bench/bench_actor.py --shape 3b --seq 4096 --samples 32 --max-tokens 8192
fi
if want grpo; then
  TAIL=30 run grpo_step 330 python3 bench/bench_grpo_step.py --json "$OUT/grpo_step.json"
fi
if want trl; then
  TAIL=20 run trl_grpo 330 python3 bench/bench_trl_grpo.py --json "$OUT/trl_grpo.json"
fi
if want quickstart; then
  TAIL=15 run quickstart_gpu 90 bash -c "python3 -m tools.make_tiny_model --out /tmp/tiny && \
    python3 -m verl_mcore.train --config configs/quickstart.yaml model.path=/tmp/tiny \
    trainer.device=cuda trainer.total_steps=20 trainer.val_every=10 trainer.run_dir=/tmp/qs"
fi
