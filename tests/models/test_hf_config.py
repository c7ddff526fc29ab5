"""HF config.json parsing: supported families, both RoPE spellings, and named refusals."""
from __future__ import annotations

import pytest

from tests.models import hf_factory
from verl_mcore.models.hf_config import (
    RopeSpec,
    UnsupportedConfigError,
    padded_vocab_size,
    read_hf_arch,
    transformer_config,
)


def _cfg(family, **overrides) -> dict:
    return hf_factory.make_config(family, **overrides).to_dict()


def test_families_parse_to_their_quirks():
    a = {f: read_hf_arch(_cfg(f)) for f in hf_factory.FAMILIES}
    assert a["qwen2"].qkv_bias and a["qwen2"].tie_embeddings and not a["qwen2"].qk_norm
    assert a["qwen3"].qk_norm and a["qwen3"].head_dim == 32 and not a["qwen3"].qkv_bias
    assert not a["llama2"].qkv_bias and not a["llama2"].tie_embeddings
    assert a["llama31"].rope == RopeSpec(type="llama3", theta=500000.0, factor=8.0,
                                         low_freq_factor=2.0, high_freq_factor=8.0,
                                         original_max_position_embeddings=64)
    assert a["mistral"].rope == RopeSpec(theta=1e6)
    assert a["llama2"].num_kv_heads == 2 and a["llama2"].head_dim == 16


def test_legacy_rope_theta_and_rope_scaling_read_like_rope_parameters():
    new = _cfg("llama31")
    assert "rope_parameters" in new  # what transformers 5 writes
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    legacy["rope_theta"] = 500000.0
    legacy["rope_scaling"] = {"type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                              "high_freq_factor": 8.0, "original_max_position_embeddings": 64}
    assert read_hf_arch(legacy).rope == read_hf_arch(new).rope
    plain = {k: v for k, v in new.items() if k != "rope_parameters"}
    plain["rope_theta"] = 1234.0
    assert read_hf_arch(plain).rope == RopeSpec(theta=1234.0)


@pytest.mark.parametrize("family,change,field", [
    ("llama2", {"model_type": "gemma"}, "model_type"),
    ("llama2", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama2", {"attention_bias": True}, "attention_bias"),
    ("llama2", {"mlp_bias": True}, "mlp_bias"),
    ("llama2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type"),
    ("llama2", {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type"),
    ("llama2", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("mistral", {"sliding_window": 4096}, "sliding_window"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types"),
    ("llama2", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
])
def test_unsupported_fields_are_named(family, change, field):
    cfg = _cfg(family)
    cfg.update(change)
    with pytest.raises(UnsupportedConfigError, match=rf"`{field}`"):
        read_hf_arch(cfg)


def test_sliding_window_longer_than_every_sequence_is_plain_causal():
    cfg = _cfg("mistral", sliding_window=4096)
    assert read_hf_arch(cfg, max_seq_len=4096).model_type == "mistral"
    with pytest.raises(UnsupportedConfigError, match="max_seq_len <= 4096"):
        read_hf_arch(cfg, max_seq_len=4097)


def test_reads_a_saved_directory(tmp_path):
    hf_factory.make_config("qwen3").save_pretrained(tmp_path)
    assert read_hf_arch(tmp_path).qk_norm
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_arch(tmp_path / "missing")


def test_padded_vocab_is_the_same_at_every_tp_dividing_128():
    assert padded_vocab_size(250) == 256
    assert {padded_vocab_size(250, tp) for tp in (1, 2, 4, 8)} == {256}
    assert padded_vocab_size(151936, 8) == 151936  # Qwen2.5: already a multiple
    assert padded_vocab_size(100, 3) == 384  # lcm(128, 3)


def test_transformer_config_carries_the_architecture():
    arch = read_hf_arch(_cfg("qwen3"))
    cfg = transformer_config(arch, tp=2, dtype="fp32")
    assert (cfg.kv_channels, cfg.num_query_groups, cfg.qk_layernorm, cfg.add_qkv_bias) == \
        (32, 2, True, False)
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and not cfg.add_bias_linear
    assert cfg.tensor_model_parallel_size == 2 and cfg.attention_dropout == 0.0
