#!/usr/bin/env bash
# LoRA against full-parameter GRPO steps (issue 21) on one GPU, in the same call:
# bench/bench_grpo_step.py per shape in both modes (same model, prompts, reward and loss; KL loss
# against the reference, which LoRA takes from the actor's own base), then the table.
#
#   SHAPES="1.5b 3b" bash bench/bench_lora.sh        (carry: .whl with the cp312 megatron wheel)
#
# $OUT gets grpo_<shape>_<full|lora>.json / .log and lora_vs_full.md (the bench/RESULTS.md entry).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# shellcheck source=SCRIPTDIR/device_setup.sh
. bench/device_setup.sh
read -r -a shapes <<< "${SHAPES:-1.5b 3b}"
# 128 samples of 512 + 256 tokens are 8 micro-batches of exactly 12,288 tokens: the update's
# micro-batches fill their budget, the case the planner plans for (any mix of lengths can fill
# one). At 16,384 the trainer's balanced plan holds 19 samples (14,592 tokens) in its largest.
common=(--prompts 16 --n 8 --prompt-len 512 --response-len 256 --max-tokens 12288 --steps 3)
lora=(actor.lora.enable=true actor.lora.r=16 actor.lora.alpha=32 actor.optim.lr=1e-5)
for shape in "${shapes[@]}"; do
  for mode in full lora; do
    extra=(trainer.offload_between_phases=false)
    if [ "$mode" = lora ]; then extra+=("${lora[@]}"); fi
    echo "=== $shape $mode"
    python3 bench/bench_grpo_step.py --shape "$shape" "${common[@]}" --workdir "/tmp/lora_$shape" \
      --json "$OUT/grpo_${shape}_${mode}.json" "${extra[@]}" > "$OUT/grpo_${shape}_${mode}.log" 2>&1 \
      || { echo "$shape $mode failed:"; tail -20 "$OUT/grpo_${shape}_${mode}.log"; }
  done
done
python3 bench/lora_table.py "$OUT" "${shapes[@]}" | tee "$OUT/lora_vs_full.md"
