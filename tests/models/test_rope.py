"""RoPE frequencies equal transformers' for default, linear and llama3 scaling."""
from __future__ import annotations

import pytest
import torch

from tests.models import hf_factory
from verl_mcore.models.hf_config import read_hf_arch
from verl_mcore.models.rope import rope_inv_freq


def _hf_inv_freq(config):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    assert rotary.attention_scaling == 1.0  # the types we support do not scale attention
    return rotary.inv_freq


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
])
def test_inv_freq_matches_transformers(scaling):
    kw = {"rope_theta": 500000.0}
    if scaling:
        kw["rope_scaling"] = scaling
    config = hf_factory.make_config("llama2", head_dim=64, **kw)
    arch = read_hf_arch(config.to_dict())
    assert torch.equal(rope_inv_freq(arch.rope, arch.head_dim), _hf_inv_freq(config))


def test_megatron_builtin_llama3_scaling_differs_for_non_default_factors():
    """Why we install our own frequencies: megatron hard-codes 1 / 4 / 8192."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    config = hf_factory.make_config("llama31", head_dim=64)
    arch = read_hf_arch(config.to_dict())
    builtin = RotaryEmbedding(kv_channels=64, rotary_percent=1.0, rotary_base=500000,
                              rope_scaling=True, rope_scaling_factor=8.0,
                              use_cpu_initialization=True)
    assert not torch.allclose(builtin.inv_freq, rope_inv_freq(arch.rope, 64))
