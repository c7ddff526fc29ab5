"""RoPE frequencies equal transformers' for default, linear and llama3 scaling."""
from __future__ import annotations

from types import SimpleNamespace

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


# ------------------------------------------------------------------ packed (THD) RoPE


class _CPGroup:
    """Stands in for a context-parallel group of one rank."""

    def size(self):
        return 1

    def rank(self):
        return 0


_CONFIG = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False,
                          multi_latent_attention=False)


def _freqs(max_len: int, dim: int = 16) -> torch.Tensor:
    """megatron's RotaryEmbedding output for packed sequences: [max_len, 1, 1, dim] fp32."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotary = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, rotary_base=10000,
                             use_cpu_initialization=True)
    freqs = rotary.get_freqs_non_repeated(max_len)  # get_emb itself would move to CUDA
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


@pytest.mark.parametrize("lengths", [[7], [3, 1, 5], [1, 1, 1], [4, 0, 6, 1], [2, 9]],
                         ids=["one", "with-1", "all-1", "empty", "two"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("exact_mapping", [False, True], ids=["max-len", "total-len"])
def test_packed_rope_equals_megatron_bit_for_bit(lengths, dtype, exact_mapping):
    """Values and gradients equal megatron's `_apply_rotary_pos_emb_thd` (torch.equal: -0 == 0),
    with freqs of the longest sequence's length or (megatron's other branch) of every token."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from verl_mcore.models import rope

    total = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    freqs = _freqs(total if exact_mapping else max(lengths) + 3)
    g = torch.Generator().manual_seed(sum(lengths))
    t = torch.randn(total, 3, 16, generator=g).to(dtype)
    grad = torch.randn(total, 3, 16, generator=g).to(dtype)
    outs, grads = [], []
    for fn in (rope.apply_rotary_pos_emb, None):
        x = t.clone().requires_grad_(True)
        if fn is None:
            out = _apply_rotary_pos_emb_thd(x, cu, freqs, cp_group=_CPGroup())
        else:
            out = fn(x, freqs, _CONFIG, cu_seqlens=cu, cp_group=_CPGroup())
        out.backward(grad)
        outs.append(out.detach())
        grads.append(x.grad)
    assert outs[0].dtype == outs[1].dtype == dtype and outs[0].shape == outs[1].shape
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0], grads[1])


def test_packed_positions_and_cache():
    from verl_mcore.models import rope

    cu = torch.tensor([0, 3, 3, 4, 8], dtype=torch.int32)
    assert rope.thd_positions(cu, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    freqs = _freqs(8)
    first = rope._thd_cos_sin(cu, freqs, 8, torch.float32)
    assert rope._thd_cos_sin(cu, freqs, 8, torch.float32)[0] is first[0], "reused per micro-batch"
    cu[1:] = torch.tensor([1, 2, 3, 8], dtype=torch.int32)  # changed in place: not served stale
    assert rope._thd_cos_sin(cu, freqs, 8, torch.float32)[0] is not first[0]


def test_packed_rope_delegates_everything_else_to_megatron(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    from verl_mcore.models import rope

    calls = []
    monkeypatch.setattr(rope_utils, "apply_rotary_pos_emb", lambda *a, **k: calls.append(k) or "mg")
    t, freqs, cu = torch.randn(4, 2, 16), _freqs(4), torch.tensor([0, 4], dtype=torch.int32)
    cp2 = SimpleNamespace(size=lambda: 2)
    for config, kwargs in [
        (_CONFIG, {}),                                                    # padded (bshd)
        (_CONFIG, {"cu_seqlens": cu, "cp_group": cp2}),                  # context parallel
        (_CONFIG, {"cu_seqlens": cu, "mscale": 1.5, "cp_group": _CPGroup()}),
        (SimpleNamespace(**{**vars(_CONFIG), "rotary_interleaved": True}),
         {"cu_seqlens": cu, "cp_group": _CPGroup()}),
        (SimpleNamespace(**{**vars(_CONFIG), "apply_rope_fusion": True}),
         {"cu_seqlens": cu, "cp_group": _CPGroup()}),
    ]:
        assert rope.apply_rotary_pos_emb(t, freqs, config, **kwargs) == "mg"
    assert len(calls) == 5


def test_megatron_rope_signature_is_the_one_we_replace():
    """megatron's attention calls apply_rotary_pos_emb with these parameters; an upgrade that
    changes them must be looked at before the replacement is trusted."""
    import inspect

    from megatron.core.models.common.embeddings import rope_utils

    params = tuple(inspect.signature(rope_utils.apply_rotary_pos_emb).parameters)
    assert params == ("t", "freqs", "config", "cu_seqlens", "mscale", "cp_group")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_rope_on_cuda_never_syncs_and_equals_megatron():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from verl_mcore.models import rope

    lengths = [700, 1, 2048, 33, 1314]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                      device="cuda")
    freqs = _freqs(max(lengths), dim=128).cuda()
    t = torch.randn(sum(lengths), 16, 128, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours = rope.apply_rotary_pos_emb(t, freqs, _CONFIG, cu_seqlens=cu, cp_group=_CPGroup())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_CPGroup())
    assert torch.equal(ours, want)
