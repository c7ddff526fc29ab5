#!/usr/bin/env bash
# The benchmark suite on one GPU machine (the device tool's H200): install the carried wheels,
# build the CUDA extension, run the chosen parts, logs and JSON under $OUT, then one dated
# results entry (bench/report.py: tables, issue 11's goals met / NOT met).
#
#   [COMMIT=sha] bash bench/gpu_suite.sh [PART...]   (carry: .whl with the cp312 megatron-core
#                                   wheel, and trl/datasets/dill/multiprocess wheels for the TRL part)
# PARTS: kernels, rollout, settings (issue 22's four rollout settings), actor, grpo, ppo (the same
# step with a critic: adv_estimator=gae), trl, tests (GPU-marked tests), rollout_settings (issue
# 22's long responses with the stage breakdown, the KV memory at a small budget, paged and one
# block a sequence, the decode step's parts and kernels), attention (decode attention kernels
# against flash, and the rollout with torch's flash kernel), quickstart (trainer on CUDA, then a
# resume from its checkpoint),
# or `all` (the default); rollout_short and actor_3b run one setting of rollout / actor, gae the
# GAE rows of the kernel bench (the trainer's call included). grpo and ppo share one random model
# in $BENCH_WORKDIR (default /tmp/bench_work); STEPS (default 3) steps each. One device call allows 10 minutes: `rollout actor tests` and
# `grpo trl` each fit in one.
#
# $OUT gets per part NAME.log and NAME.json (rollout, rollout_long, actor_1.5b, actor_3b,
# grpo_step, ppo_step, trl_grpo, kernels), commands.txt (what each part ran), all packed into
# suite_files.tar.gz at the end (the device returns at most 8 files), results_entry.md and
# summary.json, and RESULTS.md: bench/RESULTS.md with the new entry appended. The device copy of
# the tree has no .git (so pass COMMIT=$(git rev-parse --short HEAD) for the entry) and only $OUT
# comes back: copy the returned $OUT/RESULTS.md over bench/RESULTS.md to keep the entry. Parts
# split over several device calls: put their JSON files in one directory and run
# `python3 bench/report.py DIR --append` here instead.
set -uo pipefail
OUT=${OUT:-/tmp/out}
# shellcheck source=SCRIPTDIR/device_setup.sh
. bench/device_setup.sh  # wheels, PYTHONPATH, the CUDA extension
: > "$OUT/commands.txt"

run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  printf '%s\t%s\n' "$name" "$*" >> "$OUT/commands.txt"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "exit $?"; grep -v -i "warn" "$OUT/$name.log" | tail -"${TAIL:-30}"
}
want() { [[ " $PARTS " == *" $1 "* || " $PARTS " == *" all "* ]]; }
PARTS="${*:-all}"

if want tests; then
  TAIL=12 run gpu_tests 220 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/ops tests/models tests/rollout \
    tests/engine/test_optim_step.py
fi
if want gae && ! want kernels; then
  TAIL=16 run kernels_gae 120 python3 bench/bench_kernels.py --only gae --results "$OUT/kernels_gae.md" \
    --json "$OUT/kernels_gae.json"
fi
if want kernels; then
  TAIL=45 run kernels 120 python3 bench/bench_kernels.py --results "$OUT/kernels.md" \
    --json "$OUT/kernels.json"
fi
if want rollout || want rollout_short; then
  TAIL=14 run rollout 150 python3 bench/bench_rollout.py --compare-unfused --repartition \
    --json "$OUT/rollout.json"
fi
if want rollout; then
  TAIL=6 run rollout_long 200 python3 bench/bench_rollout.py --batch 64 --prompt-len 1024 \
    --new-tokens 1024 --json "$OUT/rollout_long.json"
fi
if want rollout_settings; then
  # issue 22's long responses (100 random stop ids: mean ~1,400 tokens) with the engine's stages
  # timed apart, then the KV memory at a small budget (3% of free memory) with the paged cache and
  # with torch's flash kernel (one block a sequence) -- both measured, 64 sequences so that the
  # flash run finishes --, and each decode part against its bytes with the step's kernels.
  TAIL=6 run rollout_reasoning 240 python3 bench/bench_rollout.py --skip-hf --batch 256 --prompt-len 512 \
    --new-tokens 4096 --stop-tokens 100 --n 8 --breakdown --json "$OUT/rollout_reasoning.json"
  memory=(--skip-hf --once --batch 64 --prompt-len 512 --new-tokens 4096 --stop-tokens 100 --n 8
          --gpu-memory-utilization 0.03)
  TAIL=6 VERL_MCORE_PAGED_KERNEL=triton run rollout_memory_triton 150 python3 bench/bench_rollout.py \
    "${memory[@]}" --json "$OUT/rollout_memory_triton.json"
  TAIL=6 VERL_MCORE_PAGED_KERNEL=flash run rollout_memory_flash 150 python3 bench/bench_rollout.py \
    "${memory[@]}" --json "$OUT/rollout_memory_flash.json"
  TAIL=45 run decode_parts 120 python3 bench/bench_decode_parts.py --json "$OUT/decode_parts.json"
fi
if want settings; then
  # issue 22's four settings in one call (its Done-when): 128 x (256 + 256), 64 x (1024 + 1024),
  # the GRPO step's generation (64 prompts x 8 samples x (512 + 512)) and long responses ending at
  # varied lengths (256 x (512 + up to 4096), 100 random stop ids), each against its bound
  TAIL=5 run rollout 120 python3 bench/bench_rollout.py --skip-hf --json "$OUT/rollout.json"
  TAIL=5 run rollout_long 120 python3 bench/bench_rollout.py --skip-hf --batch 64 --prompt-len 1024 \
    --new-tokens 1024 --json "$OUT/rollout_long.json"
  TAIL=5 run rollout_grpo 120 python3 bench/bench_rollout.py --skip-hf --batch 512 --prompt-len 512 \
    --new-tokens 512 --n 8 --json "$OUT/rollout_grpo.json"
  TAIL=5 run rollout_reasoning 200 python3 bench/bench_rollout.py --skip-hf --batch 256 --prompt-len 512 \
    --new-tokens 4096 --stop-tokens 100 --n 8 --json "$OUT/rollout_reasoning.json"
fi
if want attention; then
  # decode attention at issue 22's shapes: torch's flash ("sequence"), the csrc and Triton paged
  # kernels at several split counts; then the engine with torch's flash kernel instead of the
  # default Triton one
  TAIL=8 run attention_sweep 120 python3 bench/probe_paged_attention.py --sweep
  TAIL=8 VERL_MCORE_PAGED_KERNEL=flash run rollout_flash 150 python3 bench/bench_rollout.py --skip-hf \
    --json "$OUT/rollout_flash.json"
fi
if want actor; then
  TAIL=20 run actor_1.5b 110 python3 bench/bench_actor.py --shape 1.5b --seq 4096 --samples 32 \
    --json "$OUT/actor_1.5b.json"
fi
if want actor || want actor_3b; then
  # 12288-token micro-batches: the best measured on an H200 (44.9% MFU, 115 GiB peak)
  TAIL=20 run actor_3b 110 python3 bench/bench_actor.py --shape 3b --seq 4096 --samples 32 \
    --max-tokens 12288 --json "$OUT/actor_3b.json"
fi
if want grpo; then
  # The default config: offload_between_phases=auto keeps the optimizer state on a GPU with
  # memory to spare (offloading cost 10.8 s a step on the H200), old log-probs from the update.
  TAIL=30 run grpo_step 330 python3 bench/bench_grpo_step.py --steps "${STEPS:-3}" \
    --workdir "${BENCH_WORKDIR:-/tmp/bench_work}" --json "$OUT/grpo_step.json"
fi
if want ppo; then
  # PPO at the same shape and defaults: a bf16 critic with the actor's micro-batch token budget.
  TAIL=30 run ppo_step 420 python3 bench/bench_grpo_step.py --steps "${STEPS:-3}" \
    --workdir "${BENCH_WORKDIR:-/tmp/bench_work}" --json "$OUT/ppo_step.json" algorithm.adv_estimator=gae
fi
if want trl; then
  TAIL=20 run trl_grpo 330 python3 bench/bench_trl_grpo.py --json "$OUT/trl_grpo.json"
fi
if want quickstart; then
  # 6 steps saving at 3 and 6, then the same run to 9: it must resume from step 6 (checkpoint load
  # with the GPU optimizer: fused Adam, its step counts on the device) and finish.
  qs="python3 -m verl_mcore.train --config configs/quickstart.yaml model.path=/tmp/tiny \
    trainer.device=cuda trainer.val_every=0 checkpoint.save_every=3 trainer.run_dir=/tmp/qs"
  TAIL=15 run quickstart_gpu 150 bash -c "python3 -m tools.make_tiny_model --out /tmp/tiny && \
    $qs trainer.total_steps=6 && $qs trainer.total_steps=9 2>&1 | tee /tmp/qs_resume.log && \
    grep -q 'resumed from step 6' /tmp/qs_resume.log && echo 'resumed from step 6: ok'"
fi

if compgen -G "$OUT/*.json" > /dev/null; then  # the tests and quickstart parts write none
  if [ -f bench/RESULTS.md ]; then cp bench/RESULTS.md "$OUT/RESULTS.md"; fi
  echo "=== report"
  python3 bench/report.py "$OUT" --append --results "$OUT/RESULTS.md" \
    --command "bash bench/gpu_suite.sh $PARTS" ${COMMIT:+--commit "$COMMIT"}
fi
# The device returns at most 8 files: keep the report's (*.md, summary.json) and pack the rest.
pack=()
for f in "$OUT"/*.log "$OUT"/*.json "$OUT"/commands.txt; do
  [ -f "$f" ] && [ "$(basename "$f")" != summary.json ] && pack+=("$(basename "$f")")
done
if [ ${#pack[@]} -gt 0 ]; then tar czf "$OUT/suite_files.tar.gz" -C "$OUT" --remove-files "${pack[@]}"; fi
