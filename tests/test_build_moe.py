"""verl_mcore.build and config validation for mixture-of-experts models: the training config
takes the expert parallelism and the load-balancing coefficient, the generation config holds
every expert, and the layouts megatron cannot train are refused naming the key."""
import dataclasses
from types import SimpleNamespace

import pytest

from verl_mcore import build
from verl_mcore.config import Config
from verl_mcore.config.validate import ModelShape, _layout_errors, _router_replay_errors
from verl_mcore.models.hf_config import HFArch, MoESpec, RopeSpec

MOE = MoESpec(num_experts=4, topk=2, ffn_hidden_size=32, norm_topk_prob=True, layers=(0, 1),
              aux_loss_coeff=0.002)
ARCH = HFArch(model_type="qwen3_moe", num_layers=2, hidden_size=64, ffn_hidden_size=128,
              num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, norm_eps=1e-6,
              rope=RopeSpec(), qkv_bias=False, qk_norm=True, tie_embeddings=False,
              max_position_embeddings=64, moe=MOE)
SHAPE = ModelShape(num_attention_heads=4, num_key_value_heads=2, num_layers=2, vocab_size=256,
                   hidden_size=64, num_experts=4)


def _cfg(*overrides):
    return Config.load(None, list(overrides))


def test_training_config_takes_ep_and_the_coefficient_the_generation_config_all_experts():
    info = SimpleNamespace(arch=ARCH)
    cfg = _cfg("parallel.expert_model_parallel_size=2")
    train = build._transformer_config(cfg, info, "fp32", 1, 1)
    assert train.expert_model_parallel_size == 2
    assert train.moe_aux_loss_coeff == pytest.approx(0.002)  # the HF config's, by default
    gen = build._transformer_config(cfg, info, "fp32", 1, 1, training=False)
    assert gen.expert_model_parallel_size == 1
    cfg = _cfg("parallel.expert_model_parallel_size=2", "parallel.moe_aux_loss_coeff=0.05")
    assert build._transformer_config(cfg, info, "fp32", 1, 1).moe_aux_loss_coeff == 0.05


@pytest.mark.parametrize("overrides, shape, message", [
    (["parallel.expert_model_parallel_size=2"], dataclasses.replace(SHAPE, num_experts=None),
     "parallel.expert_model_parallel_size=2 needs a mixture-of-experts model"),
    (["parallel.expert_model_parallel_size=4"], dataclasses.replace(SHAPE, num_experts=6),
     "parallel.expert_model_parallel_size=4 must divide the model's 6 experts"),
    (["parallel.tensor_model_parallel_size=2"], SHAPE,
     "parallel.tensor_model_parallel_size=2 trains only with parallel.sequence_parallel=true"),
    (["parallel.moe_aux_loss_coeff=0.1"], dataclasses.replace(SHAPE, num_experts=None),
     "parallel.moe_aux_loss_coeff=0.1 is for mixture-of-experts models"),
])
def test_layouts_megatron_cannot_train_are_refused_naming_the_key(overrides, shape, message):
    errors = _layout_errors(_cfg(*overrides), 8, shape)
    assert any(message in e for e in errors), errors


def test_ep2_on_a_moe_model_is_accepted():
    assert _layout_errors(_cfg("parallel.expert_model_parallel_size=2"), 2, SHAPE) == []


def test_model_shape_reads_the_expert_count(tmp_path):
    import json

    for key in ("num_experts", "num_local_experts"):
        (tmp_path / "config.json").write_text(json.dumps(
            {"num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
             "hidden_size": 64, key: 8}))
        assert ModelShape.from_hf_dir(str(tmp_path)).num_experts == 8


@pytest.mark.parametrize("overrides, message", [
    (["actor.recompute_activations=true"], "actor.recompute_activations=true"),
    (["parallel.context_parallel_size=2"], "parallel.context_parallel_size=2"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true"),
    (["rollout.engine=vllm"], "rollout.engine=vllm"),
])
def test_routing_replay_refuses_what_it_cannot_replay_naming_the_key(overrides, message):
    errors = _router_replay_errors(_cfg("actor.router_replay=rollout", *overrides))
    assert len(errors) == 1 and errors[0].startswith("actor.router_replay=rollout cannot run "
                                                     "with " + message), errors
    assert _router_replay_errors(_cfg("actor.router_replay=off", *overrides)) == []


def test_routing_replay_of_a_dense_model_is_refused_and_its_field_declared_for_moe():
    from verl_mcore.rollout.token_fields import TOKEN_FIELDS

    dense = dataclasses.replace(SHAPE, num_experts=None)
    errors = _layout_errors(_cfg("actor.router_replay=rollout"), 2, dense)
    assert any("actor.router_replay=rollout replays a mixture-of-experts" in e for e in errors)
    assert _layout_errors(_cfg("actor.router_replay=rollout"), 2, SHAPE) == []
    info = SimpleNamespace(arch=ARCH)
    try:
        build.declare_token_fields(_cfg("actor.router_replay=rollout"), info)
        assert TOKEN_FIELDS["routed_experts"].shape == (2, 2)  # (layers, top-k)
        with pytest.raises(ValueError, match="is dense"):
            build.declare_token_fields(_cfg("actor.router_replay=rollout"),
                                       SimpleNamespace(arch=dataclasses.replace(ARCH, moe=None)))
    finally:
        build.declare_token_fields(_cfg(), info)  # off: retracted
    assert "routed_experts" not in TOKEN_FIELDS
