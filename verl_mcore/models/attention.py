"""Core attention on torch's scaled_dot_product_attention, for megatron-core's local layer spec.

megatron-core's local `DotProductAttention` builds the full [b, heads, s, s] score matrix and
rejects packed sequences. This module has the same constructor and forward signature and:
- padded batches ([s, b, heads, hd]): `F.scaled_dot_product_attention` with `is_causal=True`
  (flash / memory-efficient kernels on GPU never form the [s, s] matrix; math on CPU) and
  `enable_gqa` so K/V are not repeated per query head;
- packed sequences (THD, `PackedSeqParams.cu_seqlens_*`): on CUDA with bf16/fp16,
  `torch.nn.attention.varlen.varlen_attn` with `window_size=(-1, 0)` (causal flash varlen);
  otherwise one SDPA call per sequence.

Megatron's mask convention is True = masked out; SDPA's boolean mask is True = attend.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


@functools.lru_cache(maxsize=1)
def _varlen_attn():
    """torch's flash varlen attention (None if absent) and the keyword arguments it accepts
    (`scale` and `enable_gqa` are not in every torch version that has it)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


class SDPAttention(MegatronModule):
    """Drop-in `core_attention` for megatron-core's SelfAttention (local spec)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention: context parallelism needs the TransformerEngine spec")
        if config.apply_query_key_layer_scaling:
            raise ValueError("SDPAttention: apply_query_key_layer_scaling is not supported")
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention: softmax_type {config.softmax_type!r} is not supported")
        if config.window_size is not None:
            raise ValueError("SDPAttention: sliding-window attention is not supported")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(config.kv_channels))
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # megatron's sharded_state_dict asks every module for its TP group and reads
        # parallel_state's when it has none, which a role set of its own leaves uninitialised.
        self.tp_group = pg_collection.tp if pg_collection is not None else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        """Padded: q [sq, b, np, hn], k/v [sk, b, ng, hn] -> [sq, b, np * hn].
        Packed (THD): q [t, np, hn], k/v [t, ng, hn] -> [t, np * hn]."""
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        dropout = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"SDPAttention: packed qkv_format "
                                 f"{packed_seq_params.qkv_format!r} (only 'thd')")
            if dropout:
                raise ValueError("SDPAttention: attention dropout with packed sequences")
            return self._packed(query, key, value, packed_seq_params)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        sdpa_mask, causal = None, False
        if attention_mask is not None:
            sdpa_mask = ~attention_mask  # megatron: True = masked; SDPA: True = attend
        elif mask_type == AttnMaskType.causal:
            causal = True
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=dropout,
                                             is_causal=causal, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [sq, b, np * hn]

    def _packed(self, query, key, value, params) -> torch.Tensor:
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None \
            else params.cu_seqlens_q
        cu_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None \
            else params.cu_seqlens_kv
        varlen, accepted = _varlen_attn()
        default_scale = self.softmax_scale == 1.0 / math.sqrt(query.shape[-1])
        if (varlen is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
                and ("scale" in accepted or default_scale)):
            kwargs = {}
            if "scale" in accepted:
                kwargs["scale"] = self.softmax_scale
            if "enable_gqa" in accepted and key.shape[1] != query.shape[1]:
                kwargs["enable_gqa"] = True
            # window_size=(-1, 0): causal (no is_causal argument in varlen_attn).
            out = varlen(query, key, value, cu_q.to(torch.int32), cu_k.to(torch.int32),
                         int(params.max_seqlen_q), int(params.max_seqlen_kv),
                         window_size=(-1, 0), **kwargs)
            return out.reshape(out.shape[0], -1)
        # Per sequence: [len, heads, hn] -> [1, heads, len, hn], causal within the sequence.
        out = torch.zeros_like(query)  # tokens after the last sequence stay zero
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
        for i in range(len(bounds_q) - 1):
            q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
            if q1 == q0:
                continue
            q = query[q0:q1].transpose(0, 1).unsqueeze(0)
            k = key[k0:k1].transpose(0, 1).unsqueeze(0)
            v = value[k0:k1].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                               enable_gqa=k.shape[1] != q.shape[1])
            out[q0:q1] = o.squeeze(0).transpose(0, 1)
        return out.reshape(out.shape[0], -1)
