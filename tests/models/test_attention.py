"""SDPAttention against an explicit softmax(QK^T)V reference: causal, GQA, masks, packed THD."""
from __future__ import annotations

import math

import pytest
import torch


def _config(heads=4, groups=2, hd=8):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * hd, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=hd, attention_dropout=0.0,
                             use_cpu_initialization=True)


def _module(**kw):
    from megatron.core.transformer.enums import AttnMaskType

    from verl_mcore.models.attention import SDPAttention

    return SDPAttention(_config(**kw), layer_number=1, attn_mask_type=AttnMaskType.causal,
                        attention_type="self")


def _reference(q, k, v, allowed):
    """q [s, b, nh, d], k/v [s, b, ng, d], allowed [b or 1, 1, sq, sk] bool -> [s, b, nh*d]."""
    r = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def test_causal_gqa_matches_reference_and_backprops():
    g = torch.Generator().manual_seed(0)
    s, b = 7, 3
    q = torch.randn(s, b, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(s, b, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(s, b, 2, 8, generator=g, requires_grad=True)
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    ours = _module()(q, k, v, None)
    ref = _reference(q, k, v, causal)
    torch.testing.assert_close(ours, ref)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r)


def test_explicit_megatron_mask_means_true_is_masked():
    g = torch.Generator().manual_seed(1)
    s, b = 5, 2
    q, k, v = (torch.randn(s, b, n, 8, generator=g) for n in (4, 2, 2))
    masked = torch.rand(b, 1, s, s, generator=g) > 0.6
    masked[..., 0] = False  # every query sees at least one key
    torch.testing.assert_close(_module()(q, k, v, masked), _reference(q, k, v, ~masked))


def test_packed_thd_is_causal_within_each_sequence():
    from megatron.core.packed_seq_params import PackedSeqParams

    g = torch.Generator().manual_seed(2)
    lengths = [3, 6, 1, 4]
    t = sum(lengths)
    q, k, v = (torch.randn(t, n, 8, generator=g) for n in (4, 2, 2))
    cu = torch.tensor([0, 3, 9, 10, 14], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=6, max_seqlen_kv=6)
    ours = _module()(q, k, v, None, packed_seq_params=params)
    # Block-diagonal causal mask over the packed row == each sequence attends only to itself.
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (seq_id[:, None] == seq_id[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    ref = _reference(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), allowed[None, None])
    assert ours.shape == (t, 32)
    torch.testing.assert_close(ours, ref[:, 0])


def test_refuses_what_it_does_not_implement():
    from megatron.core.packed_seq_params import PackedSeqParams

    q = torch.zeros(4, 4, 8)
    with pytest.raises(ValueError, match="qkv_format 'sbhd'"):
        _module()(q, q[:, :2], q[:, :2], None,
                  packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="attention_bias"):
        _module()(q, q, q, None, attention_bias=torch.zeros(1))


@pytest.mark.gpu
def test_packed_varlen_on_cuda_matches_per_sequence_sdpa():
    from megatron.core.packed_seq_params import PackedSeqParams

    g = torch.Generator(device="cuda").manual_seed(3)
    lengths = [100, 37, 300, 1]
    t = sum(lengths)
    q, k, v = (torch.randn(t, n, 64, generator=g, device="cuda", dtype=torch.bfloat16)
               for n in (8, 2, 2))
    cu = torch.tensor([0, 100, 137, 437, 438], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=300, max_seqlen_kv=300)
    module = _module(heads=8, groups=2, hd=64).cuda()
    ours = module(q, k, v, None, packed_seq_params=params)
    ref = torch.cat([module(q[a:b].unsqueeze(1), k[a:b].unsqueeze(1), v[a:b].unsqueeze(1),
                            None)[:, 0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    assert (ours.float() - ref.float()).abs().max().item() < 2e-2
