"""The trainer with LoRA (issue 21), GRPO and PPO, on 1 rank and on 4 ranks at TP=2 × PP=2 with
generation TP=1: 3 steps with every metric finite; the actor's checkpoints hold the adapters only
and resume onto the uninterrupted run's numbers; the exported PEFT adapter, loaded by peft on the
Hugging Face base model, gives the trained model's logits, and so does the `--merge` export.

fp32 (the quickstart's dtype), so the logits compare at 1e-5 relative."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TOKENS = torch.tensor([[5, 9, 13, 2, 7, 21, 30, 4], [11, 3, 3, 17, 8, 1, 26, 14]])
TOL = 1e-5
FOUR = ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
        "rollout.tensor_parallel_size=1"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("lora") / "model"))


def _overrides(model, run_dir, algo, *extra, steps=3):
    out = [f"model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
           "trainer.val_every=0", "checkpoint.save_every=2", "checkpoint.keep_last=0",
           f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]", "data.val_files=[]",
           "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
           "actor.micro_batch_size_per_gpu=2", "actor.use_kl_loss=true",
           "rollout.logprob_check.num_sequences=2", "actor.optim.lr=1e-2",
           "actor.lora.enable=true", "actor.lora.r=4", "actor.lora.alpha=8",
           "actor.lora.init_lora_weights=gaussian"]
    if algo == "grpo":
        out += ["algorithm.adv_estimator=grpo", "rollout.n=2",
                "actor.lora.target_modules=[q_proj,v_proj,down_proj,lm_head]"]
    else:
        out += ["algorithm.adv_estimator=gae", "rollout.n=1", "critic.micro_batch_size_per_gpu=1",
                "critic.lora.enable=true", "critic.lora.r=4", "critic.optim.lr=1e-3"]
    return out + list(extra)


def _train(rank, world_size, overrides, tokens):
    """Train; return the exit code and the trained actor's logits on `tokens` (last stage)."""
    from megatron.core import parallel_state

    from verl_mcore.build import unwrap
    from verl_mcore.config import Config
    from verl_mcore.convert_hf.verify import megatron_logits
    from verl_mcore.trainer import Trainer

    trainer = Trainer(Config.load(str(ROOT / "configs/quickstart.yaml"), overrides))
    code = trainer.fit()
    logits = megatron_logits(unwrap(trainer.actor.engine.model[0]), tokens)
    lead = logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0
    return code, logits if lead else None


def _run(world, overrides):
    results = run_on_ranks(_train, world, args=(overrides, TOKENS), timeout=900, fresh=True)
    assert [code for code, _ in results] == [0] * world
    (logits,) = [lg for _, lg in results if lg is not None]
    return logits


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_run(run_dir: Path, algo: str, model: str) -> None:
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert r["rollout/logprob_diff_max"] < 1e-3  # generation samples from the merged adapters
    assert "actor/kl_loss" in rows[-1] and ("critic/vf_loss" in rows[-1]) == (algo == "ppo")
    step = run_dir / "checkpoints" / "actor" / "step_00000003"
    meta = json.loads((step / "meta.json").read_text())
    assert meta["trainable_only"] and meta["base_weights"] == model
    # the adapters and their optimizer state only: no base tensor is written again
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(step / "dist")).read_metadata().state_dict_metadata)
    assert any(".lora_" in k for k in keys)
    base = [k for k in keys if k == "embedding.word_embeddings.weight" or k.endswith(
        ("linear_qkv.weight", "linear_fc1.weight", "linear_fc2.weight", "layernorm.weight"))]
    assert not base, base[:4]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _check_exports(run_dir: Path, model: str, trained: torch.Tensor, tmp: Path) -> None:
    import peft
    import transformers

    step = run_dir / "checkpoints" / "actor" / "step_00000003"
    vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
    want = trained[..., :vocab]
    for flag, out in (([], tmp / "peft"), (["--merge"], tmp / "merged")):
        done = subprocess.run([sys.executable, "-m", "verl_mcore.convert_hf", "mcore-to-hf",
                               "--ckpt", str(step), "--out", str(out), "--quiet", *flag],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        if flag:
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        else:
            base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
            hf = peft.PeftModel.from_pretrained(base, str(out))
        with torch.no_grad():
            got = hf.eval()(input_ids=TOKENS).logits
        assert _rel(got, want) <= TOL, (flag, _rel(got, want))


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_lora_one_rank_trains_resumes_and_exports(model, tmp_path, algo):
    run_dir = tmp_path / "run"
    logits = _run(1, _overrides(model, run_dir, algo))
    _check_run(run_dir, algo, model)
    _check_exports(run_dir, model, logits, tmp_path)
    if algo == "ppo":  # the critic's adapter-only checkpoints resume in the GPU matrix
        return
    # Resume from step 2's adapters + optimizer state: step 3 equals the uninterrupted run's.
    again = tmp_path / "again"
    _run(1, _overrides(model, again, algo, steps=2))
    resumed = _run(1, _overrides(model, again, algo))
    a, b = _rows(run_dir)[-1], _rows(again)[-1]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/score/mean"):
        assert a[key] == b[key], (key, a[key], b[key])
    assert torch.equal(resumed, logits)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_lora_four_ranks_tp2_pp2_generation_tp1(model, tmp_path, algo):
    run_dir = tmp_path / "run"
    logits = _run(4, _overrides(model, run_dir, algo, *FOUR))
    _check_run(run_dir, algo, model)
    _check_exports(run_dir, model, logits, tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
