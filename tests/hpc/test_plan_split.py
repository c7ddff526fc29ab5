"""The planner's phase-time model and the rollout / training split it recommends (plan_time.py)."""
import json
from pathlib import Path

import pytest

from verl_mcore import plan, plan_time
from verl_mcore.config import Config
from verl_mcore.planning import memory as planner

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = [("ppo_llama3_70b.yaml", 8), ("grpo_qwen2.5_7b_gsm8k.yaml", 1), ("ppo_7b.yaml", 1)]

# A model small enough to count by hand: 2 layers, hidden 64, FFN 128, 4 heads (2 KV) of 16.
TINY = planner.ModelDims(hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, head_dim=16)
UNIT = plan_time.Hardware("unit", copy_bytes_per_s=1e9, matmul_flops_per_s=1e12,
                          train_efficiency=0.5, rollout_efficiency=0.5, host_copy_bytes_per_s=1e9,
                          link_bytes_per_s=1e9, network_bytes_per_s=1e9)
TINY_CFG = ["data.train_batch_size=4", "rollout.n=2", "data.max_prompt_length=8",
            "data.max_response_length=5", "rollout.max_num_seqs=4", "actor.ppo_mini_batch_size=4",
            "algorithm.adv_estimator=grpo", "actor.micro_batch_size_per_gpu=2"]


def _shipped(name, nodes):
    cfg = Config.load(str(ROOT / "configs" / name))
    dims = planner.resolve_dims(cfg.model.path)
    knobs = planner.Knobs(gpus_per_node=8)
    return cfg, dims, 8 * nodes, plan_time.splits(cfg, dims, 8 * nodes, knobs,
                                                  plan_time.HARDWARE["h100"])


def _step(s):  # the step formulas of plan_time's docstring, written out again
    busy = s.train_s + s.offload_s
    if s.mode == "one_step_off":
        return max(s.generate_s, busy) + s.transfer_s
    return s.generate_s + busy + s.transfer_s


def test_hand_computed_tiny_case():
    cfg = Config.load(None, TINY_CFG)
    # Generation on 2 GPUs at TP_g = 1: 2 replicas of S = 4·2/2 = 4 sequences, one wave,
    # D = 5 − 1 = 4 decode steps.
    #   layer_params = 64·64 + 2·64·32 + 64·64 (attention) + 3·64·128 (MLP) + 2·64 (norms) = 36,992
    #   W_g = 2·(2·36,992 + 64 + 100·64) = 160,896 bytes; K_g = 2·2·2·16·2 = 256 bytes per token
    #   decode = 1·4·160,896 + 4·256·(4·8 + 4·5/2) = 686,592 bytes
    #   prefill = 4·(2·73,728·8 + 2·2·4·16·8² + 2·100·64) = 4,835,328 FLOPs
    gen = (686_592 / 1e9 + 4_835_328 / 1e12) / 0.5
    assert plan_time.generation_seconds(cfg, TINY, 2, UNIT) == pytest.approx(gen, rel=1e-12)
    assert gen == pytest.approx(1.382854656e-3, rel=1e-12)
    # Training on 2 GPUs: 8 samples of s = 13 tokens, N = 73,728 + 64·100 = 80,128,
    # F = 8·(2·80,128·13 + 2·2·4·16·13·14) = 17,039,360; one on-policy step, no KL: 3F.
    train = 3 * 17_039_360 / (2 * 1e12 * 0.5)
    assert plan_time.training_seconds(cfg, TINY, 2, UNIT) == pytest.approx(train, rel=1e-12)
    # one_step_off adds the old-log-prob pass: 4F.
    stale = 4 * 17_039_360 / (2 * 1e12 * 0.5)
    assert plan_time.training_seconds(cfg, TINY, 2, UNIT, stale=True) == pytest.approx(stale, rel=1e-12)
    # Transfer: each rollout rank receives the whole bf16 model, vocabulary padded to 128:
    # 2·(128·64 + 73,984 + 64 + 128·64) = 180,864 bytes at 1 GB/s.
    xfer = 180_864 / 1e9
    assert plan_time.transfer_seconds(cfg, TINY, 2, 2, UNIT, one_node=True) == pytest.approx(xfer)
    by_key = {(s.rollout_gpus, s.mode): s for s in
              plan_time.splits(cfg, TINY, 4, planner.Knobs(gpus_per_node=4), UNIT)}
    assert by_key[(2, "sync")].step_s == pytest.approx(gen + train + xfer)
    assert by_key[(2, "one_step_off")].step_s == pytest.approx(max(gen, stale) + xfer)
    assert by_key[(0, "sync")].transfer_s == 0.0


def test_generation_matches_the_bench_roofline_at_one_gpu():
    from bench.roofline import generation_bound

    dims = planner.KNOWN_SHAPES["qwen2.5-1.5b"]
    cfg = Config.load(None, ["data.train_batch_size=16", "rollout.n=8", "rollout.max_num_seqs=128",
                             "data.max_prompt_length=256", "data.max_response_length=256"])
    hw = plan_time.HARDWARE["h200"]
    bound = generation_bound(dims, [256] * 128, 256, hw.copy_bytes_per_s, hw.matmul_flops_per_s)
    model = plan_time.generation_seconds(cfg, dims, 1, hw) * hw.rollout_efficiency
    assert model == pytest.approx(bound.seconds, rel=1e-9)
    # an FP8 generation copy (rollout.dtype=fp8): the same arithmetic over its bytes
    fp8 = generation_bound(dims, [256] * 128, 256, hw.copy_bytes_per_s, hw.matmul_flops_per_s, fp8=True)
    cfg8 = Config.load(None, ["data.train_batch_size=16", "rollout.n=8", "rollout.max_num_seqs=128",
                              "data.max_prompt_length=256", "data.max_response_length=256",
                              "rollout.dtype=fp8"])
    model8 = plan_time.generation_seconds(cfg8, dims, 1, hw) * hw.rollout_efficiency
    assert model8 == pytest.approx(fp8.seconds, rel=1e-9)
    # 0.79: at 128 x (256 + 256) the bf16 KV cache reads (~1.4 GB a step at 384 tokens) and the
    # prefill stay; the weights go from 3.09 to 1.78 GB
    assert 0.78 < model8 / model < 0.80


def test_model_against_the_measured_one_h200_step():
    """RESULTS.md 2026-12-03 13:55: the 1.5B bench step (bench/bench_grpo_step.py's config)."""
    dims = planner.KNOWN_SHAPES["qwen2.5-1.5b"]
    bench = ["data.train_batch_size=64", "rollout.n=8", "data.max_prompt_length=512",
             "data.max_response_length=512", "rollout.max_num_seqs=512",
             "actor.ppo_mini_batch_size=64", "actor.max_tokens_per_microbatch=16384",
             "critic.max_tokens_per_microbatch=16384", "actor.use_kl_loss=true",
             "algorithm.adv_estimator=grpo", "actor.micro_batch_size_per_gpu=2"]
    hw = plan_time.HARDWARE["h200"]
    grpo = Config.load(None, bench)
    assert plan_time.generation_seconds(grpo, dims, 1, hw) == pytest.approx(6.39, rel=0.1)
    assert plan_time.training_seconds(grpo, dims, 1, hw) == pytest.approx(11.11 + 3.97, rel=0.05)
    ppo = Config.load(None, bench + ["algorithm.adv_estimator=gae"])
    assert plan_time.training_seconds(ppo, dims, 1, hw) == pytest.approx(11.13 + 3.96 + 9.96, rel=0.05)


@pytest.mark.parametrize("name, nodes", SHIPPED)
def test_recommendation_is_the_argmin_of_the_modelled_step(name, nodes):
    cfg, dims, world, cands = _shipped(name, nodes)
    fitting = [s for s in cands if s.fits]
    best = min(fitting, key=_step)
    assert plan_time.recommend(cands) == best
    assert all(s.step_s == pytest.approx(_step(s)) for s in cands)
    sync = plan_time.recommend(cands, stale_ok=False)
    assert sync == min((s for s in fitting if s.mode == "sync"), key=_step)


@pytest.mark.parametrize("name, nodes", SHIPPED)
def test_every_candidate_is_a_valid_layout(name, nodes):
    cfg, dims, world, cands = _shipped(name, nodes)
    p, tp_g = cfg.parallel, cfg.rollout.tensor_parallel_size
    model = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    assert cands[0].colocated and cands[0].training_gpus == world
    for s in cands[1:]:
        assert s.rollout_gpus % tp_g == 0 and s.rollout_gpus + s.training_gpus == world
        assert s.training_gpus % model == 0
        dp = s.training_gpus // model
        assert cfg.actor.ppo_mini_batch_size * cfg.rollout.n % dp == 0
        assert cfg.data.train_batch_size % (s.rollout_gpus // tp_g) == 0
    # and the rules that leave layouts out: 128 prompts over 3 generation groups, 6 training GPUs
    # at TP×PP = 2 (DP 3) for 256 samples per mini-batch, 3 GPUs for TP_g = 2
    cfg, *_ = _shipped("grpo_qwen2.5_7b_gsm8k.yaml", 1)
    assert plan_time.split_errors(cfg, 6, 2) and plan_time.split_errors(cfg, 2, 6)
    assert plan_time.split_errors(cfg, 3, 5) and not plan_time.split_errors(cfg, 4, 4)


def test_generation_falls_and_training_rises_as_the_rollout_set_grows():
    cfg, dims, world, cands = _shipped("ppo_llama3_70b.yaml", 8)
    hw = plan_time.HARDWARE["h100"]
    tp_g = cfg.rollout.tensor_parallel_size
    gen = [plan_time.generation_seconds(cfg, dims, r, hw) for r in range(tp_g, world + 1, tp_g)]
    assert all(a > b for a, b in zip(gen, gen[1:]))
    train = [plan_time.training_seconds(cfg, dims, t, hw) for t in (32, 64)]  # TP 8 × PP 4
    assert train[0] > train[1]
    # 360 prompts × 2 split over many set sizes: R = 2, 3, 4, 6, 8, 9, 10 of 12 GPUs
    grpo = Config.load(None, TINY_CFG + ["data.train_batch_size=360", "actor.ppo_mini_batch_size=360"])
    by_r = sorted((s for s in plan_time.splits(grpo, TINY, 12, planner.Knobs(gpus_per_node=12), UNIT)
                   if s.mode == "sync" and not s.colocated), key=lambda s: s.rollout_gpus)
    assert [s.rollout_gpus for s in by_r] == [2, 3, 4, 6, 8, 9, 10]
    assert all(a.generate_s > b.generate_s and a.train_s < b.train_s for a, b in zip(by_r, by_r[1:]))


@pytest.mark.parametrize("name, nodes", SHIPPED)
def test_one_step_off_is_never_slower_than_sync_on_the_same_sets(name, nodes):
    cfg, dims, world, cands = _shipped(name, nodes)
    sync = {s.rollout_gpus: s for s in cands if s.mode == "sync"}
    for s in (s for s in cands if s.mode == "one_step_off"):
        # the same passes back to back (one_step_off's old-log-prob pass included) ...
        assert s.step_s <= s.generate_s + s.train_s + s.offload_s + s.transfer_s
        # ... and, on the shipped configs, the sync layout as it runs
        assert s.step_s <= sync[s.rollout_gpus].step_s


@pytest.mark.parametrize("name, nodes", SHIPPED)
def test_cli_prints_the_split_and_its_json(name, nodes, capsys):
    args = ["--config", str(ROOT / "configs" / name), "--nodes", str(nodes), "--gpus-per-node", "8"]
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    section = out[out.index("Rollout / training split"):]
    assert "recommended: " in section and "s per step" in section
    assert "placement.actor=" in section and "rollout.mode=one_step_off" in section
    assert "staleness 1" in section and "a model, not a measurement" in section
    assert plan.main(args + ["--json", "--gpu-kind", "h200", "--response-fraction", "0.5"]) == 0
    split = json.loads(capsys.readouterr().out)["rollout_split"]
    assert split["hardware"]["name"] == "h200" and split["response_fraction"] == 0.5
    best = min((c for c in split["candidates"] if c["fits"]), key=lambda c: c["step_s"])
    assert split["recommended"] == best


def test_placed_roles_are_not_modelled(capsys):
    args = ["--config", str(ROOT / "configs" / "ppo_7b.yaml"), "--nodes", "1", "--gpus-per-node", "8",
            "placement.actor=[0,1,2,3]", "placement.critic=[4,5,6,7]"]
    assert plan.main(args) == 0
    assert "Rollout / training split: not modelled: placement.critic" in capsys.readouterr().out
