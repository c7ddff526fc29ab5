"""The trainer end to end on a tiny Qwen2-MoE model (tools/make_tiny_model.py --moe: 4 experts,
top-2, a shared expert) at expert parallelism 2 on 2 gloo ranks: GRPO and PPO (the critic MoE
too) for 3 steps, every metric present and finite, the engine's log-probs equal to the trainer's
(the repartition gathered each EP rank's experts), and the load-balancing loss reported."""
import json
from pathlib import Path

import pytest

from tests.e2e import test_trainer as tt
from tests.multiproc import run_on_ranks


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_moe") / "model"), moe=True)


def _run(tiny_moe, run_dir: Path, algo: str):
    overrides = tt._overrides(tiny_moe, run_dir, algo, (1, 1, 1)) + [
        "parallel.expert_model_parallel_size=2", "parallel.moe_aux_loss_coeff=0.01"]
    if algo == "ppo":  # rollout.n = 1: one sample per rank and mini-batch
        overrides += tt.CRITIC_ONE_STEP + ["actor.micro_batch_size_per_gpu=1",
                                           "critic.micro_batch_size_per_gpu=1"]
    codes = run_on_ranks(tt._train, 2, args=(overrides,), timeout=600)
    assert codes == [0, 0]
    # dist checkpoints of the EP-sharded experts at steps 2 and 3 (checkpoint.save_every=2)
    assert (run_dir / "checkpoints" / "actor" / "step_00000003").is_dir()
    return tt._check_metrics(run_dir, algo, 3, values_pass=False)


@pytest.mark.slow  # ~30 s on 2 cores; the EP repartition and engine tests are the default tier's
@pytest.mark.distributed
def test_grpo_at_ep2(tiny_moe, tmp_path):
    rows = _run(tiny_moe, tmp_path / "grpo", "grpo")
    for r in rows:
        # 2 layers, 4 experts, top-2: the balanced loss is 1 (E * sum_e f_e P_e at f = P = 1/E)
        assert 0.5 < r["actor/moe_aux_loss"] < 4.0
        assert r["actor/moe_tokens_per_expert_max"] >= r["actor/moe_tokens_per_expert_mean"] > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_ppo_at_ep2(tiny_moe, tmp_path):
    rows = _run(tiny_moe, tmp_path / "ppo", "ppo")
    for r in rows:
        assert r["actor/moe_aux_loss"] > 0 and r["critic/moe_aux_loss"] > 0
        assert r["critic/moe_tokens_per_expert_max"] >= r["critic/moe_tokens_per_expert_mean"] > 0


@pytest.mark.slow  # ~40 s on 2 cores; the data path's near-tie test is the default tier's
@pytest.mark.distributed
def test_grpo_with_routing_replay(tiny_moe, tmp_path):
    """actor.router_replay=rollout on one rank for 2 steps: the engine records its routing, the
    old-log-prob (ppo_epochs 2), reference (use_kl_loss) and update passes replay it, and the
    mismatch metric is there: 0 here, where the engine and the trainer compute in fp32 on one
    device and agree on every routing decision."""
    run_dir = tmp_path / "replay"
    overrides = tt._overrides(tiny_moe, run_dir, "grpo", (1, 1, 1)) + [
        "actor.router_replay=rollout", "trainer.total_steps=2"]
    assert run_on_ranks(tt._train, 1, args=(overrides,), timeout=600) == [0]
    rows = tt._check_metrics(run_dir, "grpo", 2)
    assert [r["actor/router_replay_mismatch"] for r in rows] == [0.0, 0.0]


@pytest.mark.slow  # ~20 s on 2 cores
@pytest.mark.distributed
def test_partial_rollouts_replay_each_continued_samples_routing(tiny_moe, tmp_path):
    """Partial rollouts with routing replay and frozen weights (lr 0): samples aborted and
    continued across steps carry the routing of each piece in order, so the trainer, with the
    same weights, would have routed every token as the engine did (mismatch 0; a routing
    misaligned by a token would not be)."""
    from tests.e2e.test_partial_rollouts import _overrides as partial_overrides

    run_dir = tmp_path / "partial"
    overrides = partial_overrides(tiny_moe, run_dir, "actor.router_replay=rollout",
                                  "actor.ppo_epochs=2", "actor.optim.lr=0.0", steps=4)
    assert run_on_ranks(tt._train, 1, args=(overrides,), timeout=600) == [0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["rollout/partial/continued"] for r in rows) > 0
    assert [r["actor/router_replay_mismatch"] for r in rows] == [0.0] * 4
