"""The Python API on the tiny quickstart model, on spawned gloo ranks (tests/multiproc.py):

- examples/python_api.py runs 3 steps and its saved HF directory loads in transformers with the
  trained actor's logits (1 rank; and 2 ranks at TP=2, whose generation layout is TP_g=1, so
  generation is split over 2 replicas and the save gathers every tensor's TP shards);
- the API's 3 steps give exactly Trainer's metrics with the equivalent config (GRPO with a
  KL loss, so a reference; PPO with a critic);
- reward models, a buffer of several calls, a tokenizer object, and the errors of a wrong layout,
  stale experiences and a missing critic.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples/data/quickstart_train.parquet"
# Metrics that measure time or memory, not the algorithm.
_TIMED = ("timing_s/", "perf/", "memory", "/tokens_per_s", "/mfu", "rollout/repartition_seconds")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from verl_mcore.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def _example():
    spec = importlib.util.spec_from_file_location("python_api_example", ROOT / "examples/python_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tokens() -> torch.Tensor:
    return torch.randint(0, 36, (2, 12), generator=torch.Generator().manual_seed(0))


def _run_example(rank, world_size, model, out, tp):
    """The example; then the trained actor's megatron logits [2, 12, V] (the last stage's)."""
    from verl_mcore.build import unwrap
    from verl_mcore.convert_hf.verify import megatron_logits

    policy, history = _example().main(model, out, steps=3, tp=tp)
    logits = megatron_logits(unwrap(policy.actor.engine.model[0]), _tokens())
    vocab = policy.info.arch.vocab_size
    return {"history": history, "logits": None if logits is None else logits[..., :vocab].cpu()}


def _hf_logits(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(_tokens()).logits


def _check_example(results, model, out):
    histories = [r["history"] for r in results]
    assert len(histories[0]) == 3
    for metrics in histories[0]:
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
            assert math.isfinite(metrics[key]), key
        assert metrics["rollout/logprob_diff_max"] < 1e-3  # generation used the actor's weights
    for other in histories[1:]:  # SPMD: every rank reports the same step
        assert [m["actor/pg_loss"] for m in other] == [m["actor/pg_loss"] for m in histories[0]]
    trained = next(r["logits"] for r in results if r["logits"] is not None)
    saved = _hf_logits(out)
    rel = (saved - trained).abs().max() / saved.abs().max()
    assert rel <= 1e-5, f"saved HF model's logits differ from the trained actor's by {rel:.2e}"
    # The save holds the trained weights, not the initial ones.
    assert (_hf_logits(model) - trained).abs().max() / saved.abs().max() > 1e-3


def test_example_trains_3_steps_and_saves_an_hf_model_with_the_actors_logits(tiny_model, tmp_path):
    out = str(tmp_path / "hf")
    results = run_on_ranks(_run_example, world_size=1, args=(tiny_model, out, 1), timeout=300)
    _check_example(results, tiny_model, out)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("repeat the digit 3 : ").input_ids  # tokenizer saved


@pytest.mark.distributed
def test_example_on_two_ranks_at_tp2_agrees_and_saves(tiny_model, tmp_path):
    out = str(tmp_path / "hf")
    results = run_on_ranks(_run_example, world_size=2, args=(tiny_model, out, 2), timeout=400)
    _check_example(results, tiny_model, out)


# ---------------------------------------------------------------------------------------------
# The same run through Trainer and through the API

# DAPO's overlong handling: the worker's penalty on its scores, the PPOTrainer's masking.
OVERLONG_WORKER = ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
                   "reward.overlong_buffer.penalty_factor=0.5"]
OVERLONG_TRAINER = ["actor.mask_truncated_samples=true"]


def _shared(algo, overlong=False):
    """(Trainer overrides of configs/quickstart.yaml, API arguments) of one run."""
    n = 4 if algo == "grpo" else 2
    trainer = [f"rollout.n={n}", f"algorithm.adv_estimator={algo}", "trainer.total_steps=3",
               "trainer.val_every=0", "data.val_files=[]", "data.shuffle=false",
               "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
               "actor.micro_batch_size_per_gpu=2", "critic.micro_batch_size_per_gpu=2",
               f"data.train_files=[{TRAIN}]", "reward.num_workers=0",
               f"reward.custom_fn.path={ROOT}/examples/quickstart_reward.py",
               "reward.custom_fn.name=repeat_digit_score"]
    if algo == "grpo":
        trainer.append("actor.use_kl_loss=true")
    if overlong:
        trainer += OVERLONG_WORKER + OVERLONG_TRAINER
    return trainer, n


def _trainer_run(rank, world_size, model, run_dir, algo, overlong=False):
    from verl_mcore.config import Config
    from verl_mcore.trainer import Trainer

    overrides, _ = _shared(algo, overlong)
    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"),
                      overrides + [f"model.path={model}", f"trainer.run_dir={run_dir}"])
    Trainer(cfg).fit()
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _api_run(rank, world_size, model, algo, overlong=False):
    import pyarrow.parquet as pq

    from verl_mcore.api import Critic, ExperienceBuffer, Flow, Policy, PPOTrainer, RolloutWorker

    spec = importlib.util.spec_from_file_location("quickstart_reward",
                                                  ROOT / "examples/quickstart_reward.py")
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    _, n = _shared(algo)
    rows = pq.read_table(TRAIN).to_pylist()
    # quickstart.yaml's settings, as keyword arguments and overrides
    policy = Policy.from_pretrained(model, dtype="fp32", lr=3e-3, overrides=[
        "actor.optim.weight_decay=0.0", "actor.micro_batch_size_per_gpu=2"])
    worker = RolloutWorker(policy, max_new_tokens=8, max_prompt_length=16, temperature=1.0, n=n,
                           reward_fn=reward.repeat_digit_score,
                           overrides=OVERLONG_WORKER if overlong else ())
    critic = None
    if algo == "gae":
        critic = Critic.from_pretrained(model, dtype="fp32",
                                        overrides=["critic.micro_batch_size_per_gpu=2"])
    trainer = PPOTrainer(policy, critic, algorithm=algo,
                         kl_loss_coef=0.001 if algo == "grpo" else None,
                         overrides=OVERLONG_TRAINER if overlong else ())
    flow = Flow([worker, ExperienceBuffer(), trainer], prompts=(rows[i:i + 2] for i in range(0, 6, 2)))
    return [flow.step() for _ in range(3)]


@pytest.mark.parametrize("algo, overlong", [
    ("grpo", False), ("gae", False),
    # reward.overlong_buffer and actor.mask_truncated_samples (algo/overlong.py) in both
    pytest.param("grpo", True, marks=pytest.mark.slow, id="grpo-overlong")])
def test_api_gives_the_trainers_metrics(tiny_model, tmp_path, algo, overlong):
    """The strongest check that the API is the trainer's code: the same losses, scores, KL,
    advantages and values to the bit, step by step, on the same seed and prompts."""
    trained = run_on_ranks(_trainer_run, world_size=1,
                           args=(tiny_model, str(tmp_path / "run"), algo, overlong), timeout=300)[0]
    api = run_on_ranks(_api_run, world_size=1, args=(tiny_model, algo, overlong), timeout=300)[0]
    assert len(trained) == len(api) == 3
    for step, (t, a) in enumerate(zip(trained, api), 1):
        keys = [k for k in t if k not in ("step", "time") and not any(s in k for s in _TIMED)]
        assert keys and "actor/pg_loss" in keys and "critic/score/mean" in keys
        if algo == "gae":
            assert "critic/vf_loss" in keys and "critic/values/mean" in keys
        else:
            assert "actor/kl_loss" in keys
        overlong_keys = {"reward/overlong/penalty_mean", "reward/overlong/fraction",
                         "actor/masked_truncated_fraction"}
        assert overlong_keys <= set(keys) if overlong else not overlong_keys & set(keys)
        missing = [k for k in keys if k not in a]
        assert not missing, f"step {step}: the API has no {missing}"
        differ = {k: (t[k], a[k]) for k in keys if t[k] != a[k]}
        assert not differ, f"step {step}: Trainer vs API {differ}"


# ---------------------------------------------------------------------------------------------
# Reward models, buffers, tokenizers and the errors

def _parts(rank, world_size, model, reward_model):
    from transformers import AutoTokenizer

    from verl_mcore.api import (Critic, ExperienceBuffer, Policy, PPOTrainer, RewardModel,
                                RolloutWorker)
    from verl_mcore.config import ConfigError

    out = {}
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.model_max_length = 77  # so that the saved tokenizer is seen to be this one
    policy = Policy.from_pretrained(model, dtype="fp32", tokenizer=tokenizer)
    judge = RewardModel.from_pretrained(reward_model, policy=policy, name="judge", weight=0.5,
                                        dtype="fp32")
    # A lambda: scored in this process (it could not be pickled into scoring workers).
    worker = RolloutWorker(policy, max_new_tokens=4, n=2, reward_fn=lambda *args: 1.0,
                           reward_models=[judge])
    prompts = [f"repeat the digit {d} : " for d in "37"]
    exp = worker.generate(prompts)
    out["weighted"] = (float(exp.scores.mean()),
                       exp.metrics["reward/rule/mean"] + 0.5 * exp.metrics["reward/judge/mean"])
    out["samples"] = exp.num_samples
    trainer = PPOTrainer(policy, algorithm="grpo", mini_batch_size=2)
    buffer = ExperienceBuffer()
    buffer.add(exp)
    buffer.add(worker.generate(prompts))  # two calls: 4 prompts, two mini-batches of 2
    out["buffer_prompts"] = buffer.num_prompts
    metrics = trainer.update(buffer)
    out["update"] = {k: metrics[k] for k in ("actor/pg_loss", "actor/grad_norm")}
    out["version"] = policy.version
    for name, call in [
            ("stale", lambda: trainer.update(buffer)),
            ("layout", lambda: Critic.from_pretrained(model, tensor_parallel_size=2)),
            ("rm_as_policy", lambda: Policy.from_pretrained(reward_model, dtype="fp32")),
            ("no_critic", lambda: PPOTrainer(policy, algorithm="gae")),
            ("owner", lambda: PPOTrainer(policy, overrides=["actor.optim.lr=1.0"])),
            ("prompt", lambda: worker.generate([42, 43])),
            ("remax", lambda: PPOTrainer(policy, algorithm="remax").update(
                worker.generate(prompts)))]:
        try:
            call()
            out[name] = None
        except (ConfigError, ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    policy.save_pretrained(str(Path(model).parent / "saved"))
    return out


def test_reward_models_buffers_and_errors(tiny_model, tmp_path):
    from verl_mcore.tiny_model import make_tiny_model

    rm = make_tiny_model(str(tmp_path / "rm"), reward_model=True, seed=1)
    out = run_on_ranks(_parts, world_size=1, args=(tiny_model, rm), timeout=300)[0]
    mean, expected = out["weighted"]
    assert mean == pytest.approx(expected, abs=1e-6)  # 1 x rule + 0.5 x the reward model
    assert out["samples"] == 4 and out["buffer_prompts"] == 4 and out["version"] == 1
    assert all(math.isfinite(v) for v in out["update"].values())
    assert "after 0 policy updates, but the policy has had 1" in out["stale"]
    assert "tensor_parallel_size=2" in out["layout"] and "Policy.from_pretrained" in out["layout"]
    assert "tensor_parallel_size=1" in out["layout"]
    assert "pass critic=Critic.from_pretrained" in out["no_critic"]
    assert "'lm_head.weight' is not in the checkpoint" in out["rm_as_policy"]  # before a build
    assert "config.json names a *ForSequenceClassification" in out["rm_as_policy"]
    assert "actor.optim.lr=1.0 is a setting of Policy.from_pretrained" in out["owner"]
    assert out["prompt"].startswith("TypeError") and "prompt 0 is a int" in out["prompt"]
    assert "greedy_baseline=True" in out["remax"]
    # Saved with the tokenizer object given, not the directory's.
    saved = json.loads((Path(tiny_model).parent / "saved" / "tokenizer_config.json").read_text())
    assert saved["model_max_length"] == 77
