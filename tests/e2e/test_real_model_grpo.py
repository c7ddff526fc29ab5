"""`python -m verl_mcore.train` on the real model (SmolLM2-135M-Instruct, fp32, CPU): two GRPO steps
of 4 arithmetic chat prompts x 4 samples, responses up to 16 tokens; every step's metrics finite
and the weight-sync check run and passed (the engine samples from the actor's weights)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [(3, 4), (12, 5), (7, 8), (20, 22), (6, 9), (15, 15), (9, 1), (11, 30)]


@pytest.mark.slow
def test_two_grpo_steps_are_finite_and_the_weights_in_sync(smollm2, tmp_path):
    data = tmp_path / "sums.jsonl"
    with open(data, "w") as f:
        for i, (a, b) in enumerate(QUESTIONS):
            f.write(json.dumps({"data_source": "sums", "prompt": [
                {"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
                "reward_model": {"ground_truth": str(a + b)}, "extra_info": {"index": i}}) + "\n")
    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(ground_truth in solution_str)\n")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "verl_mcore.train", f"model.path={smollm2}",
           f"trainer.run_dir={run_dir}", "trainer.device=cpu", "trainer.total_steps=2",
           "trainer.logger=[]", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
           "data.max_prompt_length=64", "data.max_response_length=16", "data.train_batch_size=4",
           f"reward.custom_fn.path={reward}", "reward.custom_fn.name=score",
           "reward.num_workers=0", "algorithm.adv_estimator=grpo", "rollout.n=4",
           "rollout.engine=native", "actor.dtype=fp32", "reference.dtype=fp32",
           "actor.use_kl_loss=true", "actor.ppo_mini_batch_size=4",
           "actor.micro_batch_size_per_gpu=4", "actor.max_tokens_per_microbatch=2048",
           "actor.optim.lr=1e-5", "rollout.logprob_check.num_sequences=4"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "weight sync check: max |engine - trainer| log-prob" in run.stdout + run.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        assert not bad, f"step {row['step']}: non-finite {bad}"
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/score/mean",
                    "response_length/mean", "rollout/logprob_diff_max"):
            assert key in row, f"step {row['step']}: no {key}"
        # fp32 on both sides: the engine's log-probs are the actor's to rounding (the check's
        # own default bound, rollout.logprob_check.max_abs_diff, is 0.5 in fp32, 2.0 in bf16).
        assert row["rollout/logprob_diff_max"] < 1e-3, row["rollout/logprob_diff_max"]
        assert row["actor/grad_norm"] > 0
