"""The dry-run planner: shapes, memory arithmetic, layout output, refusals with knob names."""
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from verl_mcore import plan
from verl_mcore.config import Config
from verl_mcore.planning import memory as planner

ROOT = Path(__file__).resolve().parents[2]
PPO70B = str(ROOT / "configs" / "ppo_llama3_70b.yaml")


def _cfg(*overrides, path=PPO70B):
    return Config.load(path, list(overrides))


@pytest.mark.parametrize("name, billions", [
    ("meta-llama-3-8b", 8.03), ("meta-llama-3-70b", 70.55), ("qwen2.5-1.5b", 1.54),
    ("qwen2.5-3b", 3.09), ("qwen2.5-7b", 7.62), ("qwen2.5-32b", 32.76),
])
def test_known_shapes_match_published_parameter_counts(name, billions):
    assert planner.total_params(planner.KNOWN_SHAPES[name]) / 1e9 == pytest.approx(billions, abs=0.01)


def test_shape_from_local_config_json_wins(tmp_path):
    hf = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
          "model_type": "qwen2", "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    dims = planner.resolve_dims(str(tmp_path))
    assert (dims.head_dim, dims.qkv_bias, dims.tie_word_embeddings) == (16, True, True)
    assert planner.resolve_dims("Qwen/Qwen2.5-7B-Instruct") == planner.KNOWN_SHAPES["qwen2.5-7b"]
    with pytest.raises(plan.ConfigError, match="not a known shape"):
        planner.resolve_dims(str(tmp_path / "missing"))


def test_sharding_arithmetic():
    dims = planner.KNOWN_SHAPES["meta-llama-3-70b"]
    knobs = planner.Knobs(gpus_per_node=8)
    cfg = _cfg("actor.recompute_activations=false")
    full = planner.total_params(dims)
    # TP=8 × PP=4: stage params sum to the padded model (embedding and output once each).
    shards = sum(planner.stage_params(dims, 8, 4, s, 128) for s in range(4)) * 8
    assert shards == pytest.approx(full, rel=1e-3)
    a = planner.training_bytes(cfg, dims, 64, "actor", 0, knobs)
    n = planner.stage_params(dims, 8, 4, 0, 128)
    assert a["parameters"] == 2 * n and a["gradients"] == 4 * n
    assert a["optimizer"] == pytest.approx(12 * n / 2, abs=1)  # distributed over DP=2
    no_dist = planner.training_bytes(_cfg("parallel.use_distributed_optimizer=false"), dims, 64,
                                  "actor", 0, knobs)
    assert no_dist["optimizer"] == 12 * n
    recompute = planner.training_bytes(_cfg("actor.recompute_activations=true"), dims, 64, "actor", 0, knobs)
    assert recompute["activations"] < a["activations"] / 5
    # 1F1B: the first stage keeps PP micro-batches in flight, the last one.
    last = planner.training_bytes(cfg, dims, 64, "actor", 3, knobs)
    assert a["activations"] == 4 * last["activations"] and "logits" in last and "logits" not in a
    # Materialized attention scores only add memory.
    mat = planner.training_bytes(cfg, dims, 64, "actor", 0, planner.Knobs(attention="materialized"))
    assert mat["activations"] > a["activations"]


def test_kv_cache_formula():
    dims = planner.KNOWN_SHAPES["meta-llama-3-70b"]
    cfg = _cfg()  # 256 prompts × n=1 over DP_g=8 -> 32 sequences of 2048 tokens, TP_g=8 -> 1 KV head
    g = planner.generation_bytes(cfg, dims, 64, planner.Knobs())
    assert g["KV cache"] == 2 * 80 * 1 * 128 * 2 * 2048 * 32
    assert g["generation weights"] == 2 * planner.stage_params(dims, 8, 1, 0, 128)


def test_generation_weights_keep_the_training_vocabulary_padding():
    """TP_t = 8 -> TP_g = 4 with make_vocab_size_divisible_by = 5: the generation copy holds the
    training model's 128280 vocabulary rows (lcm(5, 8) = 40), not the 128260 of padding for TP_g."""
    dims = planner.KNOWN_SHAPES["meta-llama-3-70b"]
    cfg = _cfg("rollout.tensor_parallel_size=4", "model.make_vocab_size_divisible_by=5")
    g = planner.generation_bytes(cfg, dims, 64, planner.Knobs())
    padded_for_tp_g = planner.stage_params(dims, 4, 1, 0, 5)
    extra_rows = 2 * (128280 - 128260) // 4  # embedding and output layer, over TP_g = 4
    assert g["generation weights"] == 2 * (padded_for_tp_g + extra_rows * dims.hidden_size)


def test_70b_layout_fits_and_prints_groups(capsys):
    assert plan.main(["--config", PPO70B, "--nodes", "8", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "training TP=8 × PP=4 × CP=1 × DP=2; generation TP_g=8 × DP_g=8" in out
    assert "PP groups         16 × 4: [0,16,32,48]" in out
    assert "node7: ranks [56-63]  pp 3, dp 1, tp 0-7, dp_gen 7" in out
    for phase in ("generate", "score", "actor_update", "critic_update"):
        assert f"  {phase} " in out


def test_70b_without_pipeline_is_refused_on_80gb_naming_the_fix(capsys):
    args = ["--config", PPO70B, "--nodes", "8", "--gpus-per-node", "8", "--gpu-memory-gb", "80",
            "parallel.pipeline_model_parallel_size=1"]
    assert plan.main(args) == plan.EXIT_DOES_NOT_FIT  # the recipe recomputes activations
    err = capsys.readouterr().err
    assert "does not fit: actor_update, critic_update on 80 GiB GPUs" in err
    assert "parallel.pipeline_model_parallel_size=2" in err.split("makes every phase fit:")[1]
    # Without recompute no single knob is enough: pairs are proposed.
    assert plan.main(args + ["actor.recompute_activations=false",
                             "critic.recompute_activations=false"]) == plan.EXIT_DOES_NOT_FIT
    pairs = capsys.readouterr().err.split("these pairs make every phase fit:")[1].splitlines()[0]
    assert "actor.recompute_activations=true critic.recompute_activations=true + " \
           "parallel.pipeline_model_parallel_size=2" in pairs


def test_indivisible_layout_is_a_config_error(capsys):
    rc = plan.main(["--config", PPO70B, "--nodes", "8", "--gpus-per-node", "8",
                    "parallel.pipeline_model_parallel_size=3"])
    assert rc == plan.EXIT_INVALID
    err = capsys.readouterr().err
    assert "parallel.pipeline_model_parallel_size" in err and "80 layers" in err


def test_host_memory_limit_and_json(capsys):
    rc = plan.main(["--config", PPO70B, "--nodes", "8", "--gpus-per-node", "8",
                    "--host-memory-gb", "256", "--json"])
    out, err = capsys.readouterr()
    assert rc == plan.EXIT_DOES_NOT_FIT and "host" in err
    data = json.loads(out)
    assert data["does_not_fit"] == ["host"]
    ph = data["memory"]["actor_update"]
    assert ph["total"] == sum(ph["components"].values())


@pytest.mark.parametrize("config, nodes", [("grpo_qwen2.5_7b_gsm8k.yaml", 1), ("ppo_7b.yaml", 1),
                                           ("ppo_llama3_70b.yaml", 8)])
def test_shipped_recipes_fit_80gb(config, nodes, capsys):
    assert plan.main(["--config", str(ROOT / "configs" / config), "--nodes", str(nodes),
                      "--gpus-per-node", "8", "--gpu-memory-gb", "80"]) == 0


def test_no_offload_keeps_idle_state_on_gpu():
    dims = planner.KNOWN_SHAPES["meta-llama-3-70b"]
    cfg = _cfg()
    off = planner.plan_memory(cfg, dims, 64, planner.Knobs())
    on_gpu = planner.plan_memory(cfg, dims, 64, planner.Knobs(offload=False))
    assert on_gpu["host"]["per_node"] == 0 and off["host"]["per_node"] > 0
    gen = on_gpu["generate"]["components"]
    assert "actor optimizer" in gen and "critic gradients" in gen
    assert "actor optimizer" not in off["generate"]["components"]
    # While the actor updates, the critic's idle state stays too (and vice versa).
    assert "critic optimizer" in on_gpu["actor_update"]["components"]
    assert on_gpu["generate"]["total"] - off["generate"]["total"] == \
        off["host"]["per_gpu"]["actor gradients"] + off["host"]["per_gpu"]["actor optimizer"] \
        + off["host"]["per_gpu"]["critic gradients"] + off["host"]["per_gpu"]["critic optimizer"]


def test_offload_auto_offloads_only_when_a_phase_would_not_fit(capsys):
    dims70, dims7 = planner.KNOWN_SHAPES["meta-llama-3-70b"], planner.KNOWN_SHAPES["qwen2.5-7b"]
    knobs = planner.Knobs(gpus_per_node=8, gpu_memory_gib=80)
    # 70B PPO on 80 GiB: generation next to both models' idle state does not fit -> offload.
    on, why = planner.choose_offload(_cfg(), dims70, 64, knobs)
    assert on and "generate would need" in why
    # The same on 141 GiB GPUs, and a 7B recipe on 80 GiB: everything fits on the GPU -> keep it.
    assert not planner.choose_offload(_cfg(), dims70, 64, planner.Knobs(gpu_memory_gib=141))[0]
    seven = Config.load(str(ROOT / "configs" / "ppo_7b.yaml"))
    off, why = planner.choose_offload(seven, dims7, 8, knobs)
    assert not off and "every phase fits" in why
    # An explicit setting is taken as set.
    assert planner.choose_offload(_cfg("trainer.offload_between_phases=false"), dims70, 64, knobs) == \
        (False, "trainer.offload_between_phases=false")
    assert planner.choose_offload(Config.load(str(ROOT / "configs" / "ppo_7b.yaml"),
                                           ["trainer.offload_between_phases=true"]), dims7, 8, knobs)[0]
    # The CLI reports the choice; --no-offload is offload_between_phases=false, and on 70B the
    # refusal names the setting that fixes it.
    assert plan.main(["--config", PPO70B, "--nodes", "8", "--gpus-per-node", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["offload"]["enabled"] and report["memory"]["host"]["per_node"] > 0
    assert plan.main(["--config", PPO70B, "--nodes", "8", "--gpus-per-node", "8", "--no-offload"]) == 3
    err = capsys.readouterr().err
    assert "does not fit: generate" in err and "trainer.offload_between_phases=auto" in err


H200_SHAPE = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
              "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
              "model_type": "qwen2", "tie_word_embeddings": True}
H200_BENCH = ["data.train_batch_size=64", "data.max_prompt_length=512",
              "data.max_response_length=512", "rollout.n=8", "rollout.max_num_seqs=512",
              "actor.dtype=bf16", "reference.dtype=bf16", "actor.ppo_mini_batch_size=64",
              "actor.max_tokens_per_microbatch=16384", "critic.max_tokens_per_microbatch=16384",
              "actor.use_kl_loss=true", "parallel.use_distributed_optimizer=true"]
# bench/RESULTS.md 2026-12-03 13:42 UTC (commit a7c1a37), one H200, bench/bench_grpo_step.py at
# its defaults (offload off): max_memory_allocated per trainer phase, GiB.
MEASURED_GIB = {
    "grpo": {"generate": 46.14, "score": 33.85, "actor_update": 86.65},
    "gae": {"generate": 72.04, "score": 59.76, "values": 56.58, "critic_update": 103.79,
            "actor_update": 112.56},
}


@pytest.mark.parametrize("estimator", sorted(MEASURED_GIB))
def test_estimate_against_peaks_measured_on_an_h200(tmp_path, estimator):
    """The GRPO and PPO steps of the 1.5B bench: the memory model without `runtime` (outside
    torch's allocator) is within 10% of each phase's measured peak, and "auto" keeps the
    optimizer state on that GPU, as the benchmark ran (where it fit)."""
    (tmp_path / "config.json").write_text(json.dumps(H200_SHAPE))
    # The peaks were measured with the critic's values pass, which a one-step update now skips.
    overrides = [f"model.path={tmp_path}", f"algorithm.adv_estimator={estimator}",
                 "critic.recompute_values=always"] + H200_BENCH
    cfg = Config.load(None, overrides)
    dims = planner.resolve_dims(str(tmp_path))
    memory = planner.plan_memory(cfg, dims, 1, planner.Knobs(gpus_per_node=1, gpu_memory_gib=139.8, offload=False))
    for phase, gib in MEASURED_GIB[estimator].items():
        ph = memory[phase]
        estimate = (ph["total"] - ph["components"]["runtime"]) / planner.GiB
        assert estimate == pytest.approx(gib, rel=0.10), (phase, estimate, gib)
    off, why = planner.choose_offload(cfg, dims, 1, planner.Knobs(gpus_per_node=1, gpu_memory_gib=139.8))
    assert not off, why


def test_auto_offload_refuses_a_run_that_fits_neither_way(tmp_path, monkeypatch, caplog):
    """build.resolve_offload (the trainer's choice, before any model is built) on a GPU too small
    for the 1.5B PPO bench even with offload: "auto" refuses naming the phases; an explicit
    setting is taken as set, with a warning."""
    import types

    import torch

    from verl_mcore import build
    from verl_mcore.config import ConfigError

    (tmp_path / "config.json").write_text(json.dumps(H200_SHAPE))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=40 * 2**30))
    info = types.SimpleNamespace(hf_dir=str(tmp_path))
    base = [f"model.path={tmp_path}", "algorithm.adv_estimator=gae"] + H200_BENCH
    with pytest.raises(ConfigError) as err:
        build.resolve_offload(Config.load(None, base), info, 1, 1)
    assert "critic_update" in str(err.value) and "actor_update" in str(err.value)
    assert "python -m verl_mcore.plan" in str(err.value)
    with caplog.at_level("WARNING"):
        assert build.resolve_offload(Config.load(None, base + ["trainer.offload_between_phases=true"]),
                                     info, 1, 1)[0] is True
    assert "trying anyway" in caplog.text
    # On the H200 it fits with the state kept on the GPU: no refusal, offload off.
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=int(139.8 * 2**30)))
    assert build.resolve_offload(Config.load(None, base), info, 1, 1)[0] is False


def test_values_phase_only_where_the_values_pass_runs(tmp_path):
    """A one-step critic update computes the values itself (critic.recompute_values=auto): the
    plan has no values phase then, and has one with =always or with several optimizer steps."""
    (tmp_path / "config.json").write_text(json.dumps(H200_SHAPE))
    dims = planner.resolve_dims(str(tmp_path))
    knobs = planner.Knobs(gpus_per_node=1, gpu_memory_gib=139.8, offload=False)
    base = [f"model.path={tmp_path}", "algorithm.adv_estimator=gae"] + H200_BENCH
    for extra, has_values in (([], False), (["critic.recompute_values=always"], True),
                              (["critic.ppo_mini_batch_size=32"], True), (["critic.ppo_epochs=2"], True),
                              (["actor.ppo_epochs=2"], True)):
        cfg = Config.load(None, base + extra)
        assert cfg.critic_values_pass is has_values, extra
        assert ("values" in planner.plan_memory(cfg, dims, 1, knobs)) is has_values, extra


def test_reward_models_count_in_every_phase(tmp_path):
    """A reward_model source: its parameters (read from its own config.json, score head in place
    of the output layer, at the training layout) are resident in every phase, and its scoring
    pass is a phase of its own."""
    (tmp_path / "config.json").write_text(json.dumps(H200_SHAPE))
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text(json.dumps({**H200_SHAPE, "architectures": ["Qwen2ForSequenceClassification"]}))
    dims = planner.resolve_dims(str(tmp_path))
    knobs = planner.Knobs(gpus_per_node=1, gpu_memory_gib=139.8, offload=False)
    base = [f"model.path={tmp_path}"] + H200_BENCH
    with_rm = base + ["reward.sources=[{name: rule, type: rule}, {name: rm, type: reward_model, "
                      f"path: {rm}, dtype: bf16}}]"]
    plain = planner.plan_memory(Config.load(None, base), dims, 1, knobs)
    scored = planner.plan_memory(Config.load(None, with_rm), dims, 1, knobs)
    # 1.5B shape, tied embeddings at PP=1: the whole model without a second vocab matrix, bf16.
    rm_bytes = 2 * planner.stage_params(dims, 1, 1, 0, 128)
    assert "reward" in scored and "reward" not in plain
    for phase in ("generate", "score", "actor_update"):
        assert scored[phase]["components"]["reward model parameters"] == rm_bytes
        assert scored[phase]["total"] - plain[phase]["total"] == rm_bytes
    assert scored["reward"]["components"]["reward model activations"] > 0


GRPO7B = str(ROOT / "configs" / "grpo_qwen2.5_7b_gsm8k.yaml")
PPO7B = str(ROOT / "configs" / "ppo_7b.yaml")


def _qwen7b_adapters(r: int, tp: int) -> tuple[int, int]:
    """(adapter parameters of Qwen2.5-7B with all-linear LoRA, whole; on one TP rank), by hand:
    q/k/v and gate/up are column-parallel (A [r, in] whole, B [out / t, r]), o and down
    row-parallel (A [r, in / t], B [out, r] whole)."""
    h, f, q, kv, layers = 3584, 18944, 28 * 128, 4 * 128, 28
    whole = layers * r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))
    col = lambda out, inp: r * inp + out // tp * r  # noqa: E731
    row = lambda out, inp: r * inp // tp + out * r  # noqa: E731
    local = layers * (col(q, h) + 2 * col(kv, h) + row(h, q) + 2 * col(f, h) + row(h, f))
    return whole, local


def test_lora_counts_and_memory_on_the_qwen7b_grpo_recipe():
    """actor.lora on the 7B GRPO recipe (TP=2 × DP=4, KL loss, TP_g = TP_t): the base keeps only
    its bf16 weights, the adapters get gradients and (ZeRO-1) optimizer state, the reference
    has no weights of its own, and generation gets a copy of its own (the merged weights)."""
    dims = planner.KNOWN_SHAPES["qwen2.5-7b"]
    knobs = planner.Knobs(gpus_per_node=8, offload=False)
    full_cfg = _cfg(path=GRPO7B)
    lora_cfg = _cfg("actor.lora.enable=true", path=GRPO7B)  # r=8, alpha=16, all-linear
    whole, local = _qwen7b_adapters(8, 2)
    assert whole == 20_185_088  # what peft prints for Qwen2.5-7B, all-linear r=8
    assert planner.lora_trainable_params(dims, lora_cfg.actor.lora, "actor") == whole
    assert planner.trainable_params(lora_cfg, dims, "actor", 0) == local == 12_902_400
    n = planner.stage_params(dims, 2, 1, 0, 128)  # the base on one rank
    assert planner.trainable_params(full_cfg, dims, "actor", 0) == n

    full = planner.plan_memory(full_cfg, dims, 8, knobs)
    lora = planner.plan_memory(lora_cfg, dims, 8, knobs)
    up_full, up = full["actor_update"]["components"], lora["actor_update"]["components"]
    assert up["actor parameters"] == 2 * (n + local)
    assert (up["actor gradients"], up["actor optimizer"]) == (4 * local, math.ceil(12 * local / 4))
    assert (up_full["actor gradients"], up_full["actor optimizer"]) == (4 * n, math.ceil(12 * n / 4))
    # x·Aᵀ kept per adapted part (3 in linear_qkv, 2 in linear_fc1, o, down): r bf16 values a
    # token, for every layer over the 4096 tokens of a micro-batch.
    assert up["actor activations"] - up_full["actor activations"] == 28 * 4096 * 7 * 8 * 2
    assert up_full["reference parameters"] == 2 * n and "reference parameters" not in up
    saved = (2 * n + 4 * n + math.ceil(12 * n / 4)) \
        - (2 * local + 4 * local + math.ceil(12 * local / 4) + 28 * 4096 * 7 * 8 * 2)
    assert full["actor_update"]["total"] - lora["actor_update"]["total"] == saved
    # lora.dropout keeps each adapted linear's dropped input and its 1-byte mask (o and down
    # see their TP shard of the input); sequence parallelism keeps the gathered input of the
    # linear_qkv and linear_fc1 adapters, and o's and down's x·Aᵀ for this rank's tokens only.
    act, adapters = planner.lora_activation_bytes_per_token_layer, lora_cfg.actor.lora
    assert act(dims, adapters, 2, False) == 7 * 8 * 2
    assert act(dims, replace(adapters, dropout=0.1), 2, False) == \
        7 * 8 * 2 + (2 + 1) * (3584 + 3584 // 2 + 3584 + 18944 // 2)
    assert act(dims, adapters, 2, True) == 5 * 8 * 2 + 2 * 8 * 2 // 2 + 2 * 3584 * 2
    for phase in ("generate", "score"):
        assert "reference parameters" in full[phase]["components"]
        assert "reference parameters" not in lora[phase]["components"]
    # TP_g = TP_t and PP = 1: without LoRA the actor's weights serve generation in place.
    assert full["generate"]["components"]["generation weights"] == 0
    assert lora["generate"]["components"]["generation weights"] == 2 * n
    # Checkpoints: the adapters in bf16 and their fp32 master copy and Adam moments.
    assert planner.checkpoint_bytes(lora_cfg, dims) == {"actor": whole * (2 + 12)}
    assert planner.checkpoint_bytes(full_cfg, dims) == {"actor": 2 * n * (2 + 12)}
    no_opt = _cfg("actor.lora.enable=true", "checkpoint.save_optimizer=false", path=GRPO7B)
    assert planner.checkpoint_bytes(no_opt, dims) == {"actor": whole * 2}


def test_lora_critic_trains_its_value_head_too():
    """critic.lora on the 7B PPO recipe (TP=4): the value head [1, h] trains beside the adapters
    (gradients, optimizer state, checkpoint); a q/v-only actor counts only those modules."""
    dims = planner.KNOWN_SHAPES["qwen2.5-7b"]
    cfg = _cfg("critic.lora.enable=true", "actor.lora.enable=true", "actor.lora.r=16",
               "actor.lora.target_modules=[q_proj,v_proj]", path=PPO7B)
    whole, local = _qwen7b_adapters(8, 4)
    assert planner.lora_trainable_params(dims, cfg.critic.lora, "critic") == whole + 3584
    assert planner.trainable_params(cfg, dims, "critic", 0) == local + 3584
    qv = 28 * 16 * ((3584 + 28 * 128) + (3584 + 4 * 128))
    assert planner.lora_trainable_params(dims, cfg.actor.lora, "actor") == qv
    t = planner.training_bytes(cfg, dims, 8, "critic", 0, planner.Knobs())
    assert t["gradients"] == 4 * (local + 3584)
    assert planner.checkpoint_bytes(cfg, dims) == {"actor": qv * 14, "critic": (whole + 3584) * 14}
    assert planner.lora_summary(cfg, dims, "actor") == (
        f"actor LoRA: {qv:,} trainable parameters, {100 * qv / planner.total_params(dims):.3f}% of "
        "the model's 7,615,616,512; r=16, alpha=16, targets q_proj,v_proj")
    assert "(with the value head)" in planner.lora_summary(cfg, dims, "critic")
    # A critic's lora is not read where no critic runs (GRPO).
    assert planner.lora_roles(_cfg("critic.lora.enable=true", path=GRPO7B)) == []


def test_plan_cli_reports_what_lora_trains_and_saves(capsys):
    args = ["--config", GRPO7B, "--nodes", "1", "--gpus-per-node", "8", "actor.lora.enable=true"]
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert "actor LoRA: 20,185,088 trainable parameters, 0.265% of the model's 7,615,616,512; " \
           "r=8, alpha=16, " \
           "targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj" in out
    assert "LoRA saves " in out and "GiB per GPU at the peak" in out
    assert plan.main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)["lora"]
    # Against the plan of the same config without LoRA, as this CLI plans it.
    assert plan.main(["--config", GRPO7B, "--nodes", "1", "--gpus-per-node", "8", "--json"]) == 0
    without = json.loads(capsys.readouterr().out)["memory"]
    peak = max((p for p in without if p != "host"), key=lambda p: without[p]["total"])
    assert (report["peak_phase_without"], report["peak_bytes_without"]) == (peak, without[peak]["total"])
    assert report["saved_bytes"] == without[peak]["total"] - report["peak_bytes"] > 20 * planner.GiB
    assert report["trainable_params"] == {"actor": 20_185_088}
