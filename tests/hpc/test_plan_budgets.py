"""Micro-batch token budgets by default (planning/memory.choose_token_budgets, and
build.resolve_micro_batches, which the trainer and the Python API run): the ladder, the choice
against the GPU's memory and the offload policy, what an explicit setting keeps, what the log
and `verl-mcore-plan` say."""
import json
from pathlib import Path

import pytest

from verl_mcore import plan
from verl_mcore.config import Config
from verl_mcore.planning import memory as planner

ROOT = Path(__file__).resolve().parents[2]
# The 1.5B GRPO bench's shape and batch (bench/bench_grpo_step.py), micro-batches left unset.
BENCH = ["model.path=Qwen/Qwen2.5-1.5B", f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]",
         "data.train_batch_size=64", "data.max_prompt_length=512",
         "data.max_response_length=512", "rollout.n=8", "rollout.max_num_seqs=512",
         "rollout.gpu_memory_utilization=0.5", "algorithm.adv_estimator=grpo",
         "actor.ppo_mini_batch_size=64", "actor.use_kl_loss=true",
         "parallel.use_distributed_optimizer=true", "trainer.device=cuda"]
DIMS = planner.KNOWN_SHAPES["qwen2.5-1.5b"]


def _cfg(*overrides):
    return Config.load(None, BENCH + list(overrides))


def test_the_default_leaves_both_settings_to_the_planner():
    cfg = Config.load(None, [])
    assert cfg.actor.micro_batch_size_per_gpu is None and cfg.actor.max_tokens_per_microbatch is None
    assert cfg.critic.micro_batch_size_per_gpu is None and cfg.critic.max_tokens_per_microbatch is None
    assert planner.budget_roles(Config.load(None, ["algorithm.adv_estimator=gae"])) == ["actor", "critic"]
    # An explicit setting, either one, takes the role away from the planner.
    assert planner.budget_roles(Config.load(None, ["actor.micro_batch_size_per_gpu=2"])) == []
    assert planner.budget_roles(Config.load(None, ["actor.max_tokens_per_microbatch=512"])) == []


def test_ladder_from_the_mini_batch_down_to_one_sequence():
    # 64 prompts x 8 on one rank at 1024 tokens: capped at BUDGET_CAP_TOKENS, halving to 1024.
    assert planner.budget_ladder(_cfg(), 1, ["actor"]) == [32768, 16384, 8192, 4096, 2048, 1024]
    # A rank's whole mini-batch below the cap is the top (a larger budget holds nothing more).
    small = _cfg("data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
                 "data.max_prompt_length=100", "data.max_response_length=20")
    assert planner.budget_ladder(small, 1, ["actor"]) == [960, 512, 256, 128, 120]
    # A sequence longer than the cap is the only budget.
    long = _cfg("data.max_prompt_length=40000", "data.max_response_length=1000")
    assert planner.budget_ladder(long, 1, ["actor"]) == [41000]


@pytest.mark.parametrize("gib, adv, tokens", [(141, "grpo", 16384), (141, "gae", 16384),
                                              (80, "grpo", 8192), (80, "gae", 4096)])
def test_largest_budget_that_fits_without_offload(gib, adv, tokens):
    """The same numbers `verl-mcore-plan` printed for the bench config (H200: the bench's own
    hand-set 16384; H100: 16384 would need offloading between phases)."""
    cfg = _cfg(f"algorithm.adv_estimator={adv}")
    out, why = planner.choose_token_budgets(cfg, DIMS, 1, planner.Knobs(gpus_per_node=1, gpu_memory_gib=gib))
    roles = ["actor"] + (["critic"] if adv == "gae" else [])
    assert [getattr(out, r).max_tokens_per_microbatch for r in roles] == [tokens] * len(roles)
    assert set(why) == set(roles) and "on the GPU" in why["actor"]
    kept = planner.Knobs(gpus_per_node=1, gpu_memory_gib=gib, offload=False)
    assert not planner.misfits(planner.plan_job_memory(out, DIMS, 1, kept), kept)
    if tokens < planner.BUDGET_CAP_TOKENS:  # the next budget up needs the offload
        bigger = planner.with_token_budget(cfg, roles, tokens * 2)
        assert planner.misfits(planner.plan_job_memory(bigger, DIMS, 1, kept), kept)


def test_offload_only_when_no_efficient_budget_fits_on_the_gpu():
    # 50 GiB: no budget of >= 4096 tokens fits with the training state kept on the GPU, so
    # "auto" takes the largest that fits with it offloaded between phases.
    cfg = _cfg()
    out, why = planner.choose_token_budgets(cfg, DIMS, 1, planner.Knobs(gpus_per_node=1, gpu_memory_gib=50))
    assert "offloaded" in why["actor"]
    assert out.actor.max_tokens_per_microbatch >= planner.BUDGET_EFFICIENT_TOKENS
    # Explicitly kept on the GPU: the offload policy is not the planner's to change, and here
    # nothing fits that way (the trainer's offload check then refuses, naming the phases).
    kept, why = planner.choose_token_budgets(_cfg("trainer.offload_between_phases=false"), DIMS, 1,
                                             planner.Knobs(gpus_per_node=1, gpu_memory_gib=50))
    assert kept.actor.max_tokens_per_microbatch == 1024 and "no budget" in why["actor"]
    # At 70 GiB it does fit on the GPU, with a smaller budget than offloading would allow.
    kept, why = planner.choose_token_budgets(_cfg("trainer.offload_between_phases=false"), DIMS, 1,
                                             planner.Knobs(gpus_per_node=1, gpu_memory_gib=70))
    assert kept.actor.max_tokens_per_microbatch == 8192 and "on the GPU" in why["actor"]
    # Nothing fits: one full sequence, and the offload check names what does not fit.
    tiny, why = planner.choose_token_budgets(cfg, DIMS, 1, planner.Knobs(gpus_per_node=1, gpu_memory_gib=30))
    assert tiny.actor.max_tokens_per_microbatch == 1024 and "no budget" in why["actor"]


def test_report_names_the_path_of_each_role():
    cfg = _cfg("algorithm.adv_estimator=gae", "critic.micro_batch_size_per_gpu=4")
    out, why = planner.choose_token_budgets(cfg, DIMS, 1, planner.Knobs(gpus_per_node=1, gpu_memory_gib=141))
    lines = planner.micro_batch_report(out, why)
    assert lines[0].startswith("actor: packed micro-batches of 16384 tokens (planner: ")
    assert lines[1].startswith("critic: padded micro-batches of 4 samples "
                               "(critic.micro_batch_size_per_gpu as set")
    given = planner.micro_batch_report(_cfg("actor.max_tokens_per_microbatch=2048"), {})
    assert given == ["actor: packed micro-batches of 2048 tokens "
                     "(actor.max_tokens_per_microbatch as set)"]


def test_plan_cli_shows_the_budget(capsys):
    args = ["--gpu-memory-gb", "80"] + BENCH
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert "Micro-batches:\n  actor: packed micro-batches of 8192 tokens (planner: " in out
    assert plan.main(args + ["--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["micro_batches"]["actor"]
    assert (shown["path"], shown["tokens"]) == ("packed", 8192) and shown["why"].startswith("planner: ")


def test_trainer_resolution_on_cpu(tmp_path):
    """build.resolve_micro_batches on CPU: no device memory to fit, at most CPU_TOKEN_BUDGET
    tokens; an explicit padded setting is kept and reported."""
    from verl_mcore import build

    cfg = Config.load(str(ROOT / "configs" / "quickstart.yaml"), ["actor.micro_batch_size_per_gpu=null"])
    out, lines = build.resolve_micro_batches(cfg, None, 1, 1)
    # 16 prompts x 8 samples x (16 + 8) tokens = 3072 <= 4096: the whole mini-batch.
    assert out.actor.max_tokens_per_microbatch == 3072
    assert lines == ["actor: packed micro-batches of 3072 tokens (planner: on CPU: the largest "
                     "budget of at most 4096 tokens of 3072, 2048, ... 24)"]
    big = Config.load(str(ROOT / "configs" / "quickstart.yaml"),
                      ["actor.micro_batch_size_per_gpu=null", "data.max_response_length=200"])
    assert build.resolve_micro_batches(big, None, 1, 1)[0].actor.max_tokens_per_microbatch == 4096
    kept, lines = build.resolve_micro_batches(Config.load(str(ROOT / "configs" / "quickstart.yaml")), None, 1, 1)
    assert kept.actor.micro_batch_size_per_gpu == 32 and kept.actor.max_tokens_per_microbatch is None
    assert lines[0].startswith("actor: padded micro-batches of 32 samples")
