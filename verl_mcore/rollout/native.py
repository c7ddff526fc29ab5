"""The native generation engine: the generation-layout megatron GPTModel with a KV cache.

The engine drives the model's own megatron submodules one layer at a time, so tensor-parallel
communication stays inside megatron's parallel linears and the weights are exactly the ones the
repartition wrote (or the training model's, when the layouts agree):

    embedding -> per layer: input_layernorm, linear_qkv -> q, k, v (megatron's group-interleaved
    layout) -> q/k layernorm -> RoPE (the model's own inv_freq) -> cached attention -> linear_proj;
    pre_mlp_layernorm, mlp -> final_layernorm -> output_layer (vocab-parallel logits)

Paged KV cache (rollout/kv_blocks.py): one tensor [layers, 2, blocks, block_size, groups, hd];
each sequence holds blocks as it grows, listed in its row of a block table, so memory follows the
tokens in use, not slots x max length. The n samples of a prompt admitted together share its
full prompt blocks (prefilled once; each copies only the last, partial one). Sequences are
admitted while slots and blocks last; when the live ones outgrow the blocks, the most recently
admitted is preempted (blocks freed) and later recomputed from its prompt and the tokens it had.

The decode loop runs on the device: a step is the forward, `sampling.sample` with counter-based
uniforms computed on the device (`sampling.uniforms_device`), and the stop and length checks,
which update each slot's next token, position and liveness in place (`_DecodeState`). The host
looks every `steps_per_sync` steps: it collects the round's tokens, frees finished sequences'
slots and blocks, admits waiting ones and hands out the blocks the next round needs.

Sampling: a sequence's token at step t is drawn with uniform (seed, prompt, sample, t), so it
depends on neither the batch nor the slot nor preemption. Under TP_g > 1 the vocab-parallel
logits are not gathered: `tp_sampling.sample_vocab_parallel` draws from the shards the tokens
`sample` would draw (up to float rounding at CDF boundaries), exchanging a few numbers per
sequence within the generation TP group; every rank of the group gets the same tokens.

On CUDA the whole decode step is one CUDA graph per batch shape and sampling setting (at TP_g > 1
the graph holds the forward; the sampler's collectives follow it). With the csrc/ extension the
step runs fused kernels (verl_mcore/ops/decode.py: residual add + RMSNorm, rotary + KV-cache
write), and attention is torch's flash kernel over the paged cache (`seqused_k` and a block
table: it reads only each sequence's own blocks, so one graph serves every mix of lengths; its
blocks are 256 tokens). Elsewhere (CPU, fp32) attention is the reference, which reads all of a
row's blocks and masks.

With rollout.dtype=fp8 the decoder layers' four linears read an e4m3 copy of their weights
(rollout/fp8_weights.py, `_CachedGPT._linear`): the GEMMs quantize their input per token and run
torch._scaled_mm (ops/fp8.py) in both the plain and the fused step; the embedding, norms and LM
head stay in the model's dtype.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import time
import warnings
from collections import OrderedDict, deque
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_mcore.ops import decode as decode_ops
from verl_mcore.ops import triton_paged
from verl_mcore.rollout import kv_blocks
from verl_mcore.rollout import sampling as sampling_mod
from verl_mcore.rollout import serving
from verl_mcore.rollout import tp_sampling
from verl_mcore.rollout.base import RolloutEngine, SampleOutput, SamplingParams
from verl_mcore.rollout.fp8_weights import Fp8LinearWeights
from verl_mcore.rollout.moe_mlp import MoEDecodeMLP, is_moe_layer

_SP_FLAGS = ("sequence_parallel", "reduce_scatter_embeddings")


@contextlib.contextmanager
def _sequence_parallel_off(model: torch.nn.Module):
    """Run a model built with sequence parallelism (the training model, when it serves
    generation as it is) without it: a decode step has one token, which cannot be split over
    TP. Megatron's parallel linears and embeddings read these flags (on themselves and on their
    config) at forward time; they are restored afterwards."""
    holders = [m for m in model.modules()] + list({id(m.config): m.config for m in model.modules()
                                                   if hasattr(m, "config")}.values())
    switched = [(h, f) for h in holders for f in _SP_FLAGS if getattr(h, f, False) is True]
    for h, f in switched:
        setattr(h, f, False)
    try:
        yield
    finally:
        for h, f in switched:
            setattr(h, f, True)


class _CachedGPT:
    """The layer-by-layer forward of a megatron GPTModel with a slot-indexed KV cache.

    fp8: the e4m3 copy of the decoder layers' linear weights (rollout.dtype=fp8,
    rollout/fp8_weights.py): the four linears of each layer run through it (`_linear`), the
    embedding, norms and LM head through the model's own modules."""

    def __init__(self, model: torch.nn.Module, fp8: Optional[Fp8LinearWeights] = None):
        self.model = model
        self.fp8 = fp8
        cfg = model.config
        unsupported = {
            "rotary_interleaved": cfg.rotary_interleaved,
            "apply_residual_connection_post_layernorm": cfg.apply_residual_connection_post_layernorm,
            "multi_latent_attention": getattr(cfg, "multi_latent_attention", False),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"native rollout engine: generation model config sets {bad}; build "
                             "the generation model without them")
        if getattr(model, "rotary_pos_emb", None) is None:
            raise ValueError("native rollout engine: the model has no rotary_pos_emb (RoPE models only)")
        if getattr(model, "position_embedding_type", "rope") != "rope":
            raise ValueError("native rollout engine: only RoPE position embeddings are supported")
        self.layers = list(model.decoder.layers)
        # Each layer's MLP as the engine calls it: a MoE layer through rollout/moe_mlp.py.
        self.mlps = [MoEDecodeMLP(layer.mlp, f"layer {i}") if is_moe_layer(layer.mlp) else layer.mlp
                     for i, layer in enumerate(self.layers)]
        self.moe_layers = [i for i, m in enumerate(self.mlps) if isinstance(m, MoEDecodeMLP)]
        attn = self.layers[0].self_attention
        self.tp_size = attn.world_size if hasattr(attn, "world_size") else 1
        if cfg.num_query_groups is not None and cfg.num_query_groups < self.tp_size:
            raise ValueError(f"native rollout engine: {cfg.num_query_groups} KV groups over TP_g="
                             f"{self.tp_size}: choose a generation TP that divides the KV groups")
        self.heads = attn.num_attention_heads_per_partition
        self.groups = attn.num_query_groups_per_partition
        self.head_dim = attn.hidden_size_per_attention_head
        self.scale = (cfg.softmax_scale if getattr(cfg, "softmax_scale", None)
                      else 1.0 / math.sqrt(self.head_dim))
        self.fp32_residual = cfg.fp32_residual_connection
        # The activations' dtype: the embedding's (an in-place FP8 store turned the linear
        # weights into e4m3).
        param = model.embedding.word_embeddings.weight if hasattr(model, "embedding") else next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self._rope_len = 0
        self._cos = self._sin = None
        self.cache: Optional[torch.Tensor] = None  # [layers, 2, blocks, block_size, groups, hd]
        from megatron.core.transformer.mlp import MLP

        # megatron's MLP computes silu(gate) * up with nothing else around it (see `_mlp`)
        self.plain_swiglu = (
            cfg.gated_linear_unit and cfg.activation_func is torch.nn.functional.silu
            and not getattr(cfg, "use_te_activation_func", False)
            and not getattr(cfg, "glu_linear_offset", 0.0)
            and getattr(cfg, "activation_func_clamp_value", None) is None
            and all(type(layer.mlp) is MLP for layer in self.layers))
        if fp8 is not None:
            bad = [k for k, v in (("use_te_activation_func", getattr(cfg, "use_te_activation_func", False)),
                                  ("glu_linear_offset", getattr(cfg, "glu_linear_offset", 0.0)),
                                  ("activation_func_clamp_value",
                                   getattr(cfg, "activation_func_clamp_value", None))) if v]
            if bad:
                raise ValueError(f"native rollout engine: rollout.dtype=fp8 computes the MLP itself "
                                 f"(fc1, activation, fc2), without {bad}; use rollout.dtype=auto")

    def rope_tables(self, length: int) -> bool:
        """cos/sin [length, hd] in the activation dtype, from the model's inv_freq (which
        models/rope.py may have replaced, e.g. for Llama-3 scaling). True when they grew (new
        tensors: CUDA graphs over the old ones are stale)."""
        if length <= self._rope_len:
            return False
        inv_freq = self.model.rotary_pos_emb.inv_freq.to(self.device, torch.float32)
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        self._rope_len = length
        return True

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [s, b, 1, hd] of positions [b, s], gathered once per forward for every layer."""
        return (self._cos[positions].transpose(0, 1).unsqueeze(2),
                self._sin[positions].transpose(0, 1).unsqueeze(2))

    def _qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [s, b, H] (normed) -> q [s, b, nh, hd], k/v [s, b, ng, hd], RoPE applied."""
        attn = layer.self_attention
        s, b = x.shape[0], x.shape[1]
        mixed, _ = self._linear(attn.linear_qkv, x)  # bias (if any) is added inside: skip_bias_add=False
        r = self.heads // self.groups
        mixed = mixed.view(s, b, self.groups, (r + 2) * self.head_dim)
        q, k, v = torch.split(mixed, [r * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(s, b, self.heads, self.head_dim)
        if attn.q_layernorm is not None:
            q = attn.q_layernorm(q)
        if attn.k_layernorm is not None:
            k = attn.k_layernorm(k)
        return decode_ops.rotary(q, cos, sin), decode_ops.rotary(k, cos, sin), v

    def _linear(self, module, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(output, bias) of one of the layers' parallel linears: the FP8 copy's GEMM where it
        holds the module's weight, megatron's own forward otherwise."""
        if self.fp8 is not None and self.fp8.serves(module):
            return self.fp8.forward(module, x)
        return module(x)

    def _mlp_out(self, mlp, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The MLP's (output, fc2 bias): megatron's forward, or with FP8 linears the same steps
        -- fc1 (+ its bias), the (gated) activation, fc2 -- through `_linear` (the variants
        megatron adds around them are refused at construction)."""
        if self.fp8 is None or isinstance(mlp, MoEDecodeMLP):  # (FP8 refuses MoE models)
            return mlp(x)
        h, bias = self._linear(mlp.linear_fc1, x)
        if bias is not None:
            h = h + bias
        cfg = self.model.config
        if self.plain_swiglu:
            h = decode_ops.swiglu(h)
        elif cfg.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            h = cfg.activation_func(gate) * up
        else:
            h = cfg.activation_func(h)
        return self._linear(mlp.linear_fc2, h)

    @staticmethod
    def _add(residual, out_bias):
        out, bias = out_bias
        return residual + out if bias is None else residual + out + bias

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """tokens/positions [b, s] -> final hidden states [s, b, H]; `attend(i, q, k, v)` returns
        the attention output [s, b, nh * hd] of layer i and stores k/v in the cache."""
        h = self.model.embedding(input_ids=tokens, position_ids=None)  # [s, b, H]
        cos, sin = self.rope_at(positions)
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(layer, x, cos, sin)
            h = self._add(h, self._linear(layer.self_attention.linear_proj, attend(i, q, k, v)))
            h = self._add(h, self._mlp_out(self.mlps[i], layer.pre_mlp_layernorm(h)))
        return self.final_norm(h)

    def routing_shape(self) -> tuple[int, int]:
        """(layers, top-k) of one token's routing (`routing`); ValueError for a dense model."""
        if not self.moe_layers:
            raise ValueError("native rollout engine: routing is recorded for mixture-of-experts "
                             "models only; this model has no MoE layer")
        return len(self.layers), self.mlps[self.moe_layers[0]].topk

    def routing(self, index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[T, layers, k] int32: the experts each MoE layer chose in the last forward for its
        tokens (flat over [s, b], s-major, as the layers see them) at `index` [T] (None: every
        token); -1 on dense layers. The generation model holds every layer: layer i is global
        layer i, the index the trainer's ForcedRouting takes (models/router_replay.py)."""
        first = self.mlps[self.moe_layers[0]].last_experts
        rows = first.shape[0] if index is None else index.shape[0]
        out = torch.full((rows, *self.routing_shape()), -1, dtype=torch.int32, device=first.device)
        for i in self.moe_layers:
            experts = self.mlps[i].last_experts
            out[:, i] = experts if index is None else experts[index]
        return out

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        h = self.model.decoder.final_layernorm(h)
        return h.to(self.dtype) if self.fp32_residual else h

    # ------------------------------------------------------------ the fused decode step

    def fused_decode_supported(self) -> Optional[str]:
        """None when `fused_decode` can run this model on this device, else why not."""
        if not decode_ops.available(next(self.model.parameters())):
            return "the CUDA extension is not loaded (or the model is not on a GPU)"
        if self.dtype not in (torch.bfloat16, torch.float16):
            return f"activation dtype {self.dtype} (the fused kernels serve bf16/fp16)"
        cfg = self.model.config
        if cfg.normalization != "RMSNorm" or getattr(cfg, "layernorm_zero_centered_gamma", False):
            return f"normalization {cfg.normalization}"
        if self.fp32_residual:
            return "fp32_residual_connection"
        norms = [self.model.decoder.final_layernorm]
        for layer in self.layers:
            attn = layer.self_attention
            if not (_is_identity(attn.q_layernorm) and _is_identity(attn.k_layernorm)):
                return "q/k layernorm"
            if getattr(attn.linear_proj, "bias", None) is not None or \
                    getattr(getattr(layer.mlp, "linear_fc2", None), "bias", None) is not None:
                return "biases on the attention output or MLP output projection"
            norms += [layer.input_layernorm, layer.pre_mlp_layernorm]
        for norm in norms:
            params = _rmsnorm_params(norm)
            if params is None:
                return f"norm module {type(norm).__name__} (no weight / eps)"
            if params[0].dtype != self.dtype:
                return f"norm weight dtype {params[0].dtype} differs from the activations' {self.dtype}"
        return None

    def fused_decode(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                     attend) -> torch.Tensor:
        """One token per slot through the fused kernels: tokens/positions/rows [b] -> final hidden
        [1, b, H]. The token's k/v go to cache row `rows[t]` of each layer; `attend(i, q)` returns
        layer i's attention output [b, heads, hd] over the cache."""
        b = tokens.shape[0]
        r = self.heads // self.groups
        h = self.model.embedding(input_ids=tokens.unsqueeze(1), position_ids=None).contiguous()
        delta = None
        for i, layer in enumerate(self.layers):
            x = decode_ops.rmsnorm(h, delta, *_rmsnorm_params(layer.input_layernorm))
            mixed, _ = self._linear(layer.self_attention.linear_qkv, x)
            kc, vc = self.cache_rows(i)
            q = decode_ops.rope_cache(mixed.view(b, -1), self._cos, self._sin, positions, rows, kc, vc,
                                      self.groups, r, self.head_dim)
            out = attend(i, q)
            delta, _ = self._linear(layer.self_attention.linear_proj, out.view(1, b, self.heads * self.head_dim))
            x = decode_ops.rmsnorm(h, delta, *_rmsnorm_params(layer.pre_mlp_layernorm))
            delta = self._mlp(self.mlps[i], x)
        return decode_ops.rmsnorm(h, delta, *_rmsnorm_params(self.model.decoder.final_layernorm))

    def _mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        """The MLP's output (its fc2 bias refused by fused_decode_supported): megatron's own
        forward, or for a plain SwiGLU MLP fc1, the one-kernel gated activation and fc2 (megatron's
        activation is two kernels and Python around them)."""
        if not self.plain_swiglu or isinstance(mlp, MoEDecodeMLP):
            return self._mlp_out(mlp, x)[0]
        gate_up, bias = self._linear(mlp.linear_fc1, x)
        if bias is not None:
            gate_up = gate_up + bias
        return self._linear(mlp.linear_fc2, decode_ops.swiglu(gate_up))[0]

    def cache_rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values as [cache rows, groups, hd] (blocks flattened)."""
        return (self.cache[i, 0].view(-1, self.groups, self.head_dim),
                self.cache[i, 1].view(-1, self.groups, self.head_dim))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """final-normed h [s, b, H] -> vocab-parallel logits [s, b, V_local]."""
        weight = (self.model.shared_embedding_or_output_weight()
                  if self.model.share_embeddings_and_output_weights else None)
        out, _ = self.model.output_layer(h, weight=weight)
        return out


def _is_identity(module) -> bool:
    """megatron's local spec puts an IdentityOp where a model has no q/k layernorm."""
    return module is None or type(module).__name__ == "IdentityOp"


def _rmsnorm_params(norm: torch.nn.Module) -> Optional[tuple[torch.Tensor, float]]:
    """(weight, eps) of an RMSNorm module (megatron's torch or TE norm), None if it has none."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "eps", None)
    if eps is None:
        eps = getattr(norm, "epsilon", None)
    if weight is None or eps is None or getattr(norm, "bias", None) is not None:
        return None
    return weight, float(eps)


class NativeEngine(RolloutEngine):
    """Generation with the megatron model in the TP_g layout (the default engine).

    model: the generation-layout GPTModel (built with `groups.gen`), or the training model itself
        (bare or DDP-wrapped) when `generation_model_is_training_model(...)`.
    tp_group: the model's TP group (`groups.gen_tp`; None for TP_g = 1).
    vocab_size: the real (unpadded) vocabulary size; logits of padding ids are never sampled.
    repartitioner: the `Repartitioner` that fills `model` from the training chunks; None when the
        model is the training model (nothing to copy).
    keep_weights_buffer: keep the repartition buffer allocated across `sleep()`.
    max_num_seqs: decoding slots (sequences decoded at once, at most).
    gpu_memory_utilization: on CUDA, the KV cache's blocks take at most this fraction of the free
        memory; sequences are admitted while blocks last (and preempted, to be recomputed later,
        when the live ones outgrow them).
    cuda_graphs: capture the decode step.
    max_prefill_tokens: tokens (prompts x the longest of them, as padded) prefilled in one forward
        (bounds activation memory); one prompt is always admitted, whatever its length.
    fused_decode: decode with the fused kernels where supported (`fused_decode_reason` says why
        not, when not).
    block_size: tokens per KV block (None: 256 where torch's paged flash kernel serves the model,
        which needs multiples of 256, or the csrc/ paged kernel, which takes any size: 256 keeps
        one block layout for both; else 16). Where torch's flash kernel takes no block table
        (torch 2.11) but reads per-sequence lengths, a block is a whole sequence (the longest of
        the call, rounded up to 256 tokens): no prompt sharing, memory as slots x max length.
    steps_per_sync: decoding steps between the host's looks at the device: sampling, stop and length
        checks run on the device; the host collects tokens, frees finished slots and admits
        waiting sequences every this many steps (a finished slot idles until then).
    min_compact_slots: when no sequence waits and the live ones fit in fewer slots, they are
        moved into the first slots (host bookkeeping only: their KV stays in its blocks) and the
        step runs over the smallest power of two of slots that holds them, at least this many
        (0: never). A call's tail -- the last long responses -- then no longer steps every slot.
        Samples do not depend on the slot (their random stream is keyed by sequence and step), but
        on a GPU the kernels' sums may run in another order at another batch size (GEMM tiles,
        the Triton kernel's split count): the tokens are those of the uncompacted run up to float
        rounding at sampling boundaries, and the same from run to run.
    fp8_weights: the e4m3 copy of the decoder layers' linear weights to generate with
        (rollout.dtype=fp8, rollout/fp8_weights.py): `Fp8LinearWeights.in_place(model)` when
        `repartitioner` fills the model (it quantizes into the store), `.copy_of(model)` when the
        model is the training model (load_weights requantizes it from the training weights).
        Released and restored with the repartition buffer (keep_weights_buffer keeps both).
    """

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, tp_group=None,
                 repartitioner=None, keep_weights_buffer: bool = False, max_num_seqs: int = 256,
                 gpu_memory_utilization: float = 0.5, cuda_graphs: bool = True,
                 max_prefill_tokens: int = 16384, fused_decode: bool = True,
                 block_size: Optional[int] = None, steps_per_sync: int = 16, min_compact_slots: int = 16,
                 fp8_weights: Optional[Fp8LinearWeights] = None, record_routing: bool = False):
        while not hasattr(model, "decoder") and hasattr(model, "module"):
            model = model.module  # DDP / Float16Module wrappers of the training model
        if fp8_weights is not None:
            if fp8_weights.model is not model:
                raise ValueError("NativeEngine: fp8_weights were made for another model")
            if fp8_weights.in_place == (repartitioner is None):
                raise ValueError("NativeEngine: fp8_weights must be Fp8LinearWeights.in_place(model) "
                                 "with a repartitioner (it fills them), .copy_of(model) without one")
        self.fp8_weights = fp8_weights
        self.net = _CachedGPT(model, fp8_weights)
        self.model = model
        # Routing replay's engine side (actor.router_replay=rollout): each response token's
        # experts per layer, from the forward that produced it, in SampleOutput.extras.
        self.routing_shape = self.net.routing_shape() if record_routing else None
        self.vocab_size = vocab_size
        padded = model.vocab_size if hasattr(model, "vocab_size") else None
        if padded is not None and vocab_size > padded:
            raise ValueError(f"NativeEngine: vocab_size {vocab_size} exceeds the model's padded "
                             f"vocabulary {padded}")
        if steps_per_sync < 1:
            raise ValueError(f"NativeEngine: steps_per_sync must be >= 1, got {steps_per_sync}")
        if max_num_seqs < 1:
            raise ValueError(f"NativeEngine: max_num_seqs must be >= 1, got {max_num_seqs}")
        if block_size is not None and block_size < 1:
            raise ValueError(f"NativeEngine: block_size must be >= 1 (or None), got {block_size}")
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self.repartitioner = repartitioner
        self.keep_weights_buffer = keep_weights_buffer
        self.max_num_seqs = max_num_seqs
        self.gpu_memory_utilization = gpu_memory_utilization
        self.use_graphs = cuda_graphs and self.net.device.type == "cuda"
        self.max_prefill_tokens = max_prefill_tokens
        self.steps_per_sync = steps_per_sync
        self.min_compact_slots = min_compact_slots
        self.fused_decode_reason = (self.net.fused_decode_supported() if fused_decode
                                    else "fused_decode=False")
        self.fused = self.fused_decode_reason is None
        self.attention, self.attention_reason = self._attention_mode()
        if self.attention == "sequence":
            if block_size is not None:
                raise ValueError("NativeEngine: block_size is not used here: this torch's flash kernel "
                                 f"reads no paged cache, so a block is a whole sequence ({self.attention_reason})")
            block_size = 0  # set per call: the longest sequence, rounded up to 256 tokens
        elif block_size is None:
            block_size = 256 if self.attention in ("paged", "kernel", "triton") else 16
        if self.attention == "paged" and block_size % 256:
            raise ValueError(f"NativeEngine: block_size {block_size}: torch's paged flash kernel "
                             "reads blocks of multiples of 256 tokens")
        self.block_size = block_size
        # Shared prompt prefixes read once for their samples (cascade attention): the Triton
        # paged kernel's, up to this many sequences a group (0: not read that way).
        self.cascade_members = (triton_paged.cascade_members(self.net.heads // self.net.groups)
                                if self.attention == "triton" else 0)
        self.pool: Optional[kv_blocks.BlockPool] = None
        self._capped = False  # the pool is what the memory budget allowed, not what was wanted
        self._graphs: dict = {}  # (slots, width) -> _DecodeState with its captured graph
        self._graph_pool = None
        self._graph_weights: tuple = ()  # the weights' addresses the graphs were captured over
        # sleep() keeps a cache (and its graphs) of at most this many bytes; the caller sets it
        # from the memory its other work leaves free (generation.GenerationPhase.cache_budget).
        self.keep_cache_bytes = 0
        self.kept_bytes = 0
        self.last_stats: dict[str, float] = {}

    @property
    def cache(self) -> Optional[torch.Tensor]:
        return self.net.cache

    def _attention_mode(self) -> tuple[Optional[str], Optional[str]]:
        """How decode attention reads the cache (`decode_ops.paged_attention`'s flash argument)
        and why: "triton" (ops/triton_paged.py: the default on a GPU where Triton is installed and
        the kernel passes its self-check; it measured faster than torch's flash kernel at every
        decode shape, bench/RESULTS.md 2026-12-06), "paged" (torch's flash kernel with a block
        table), "sequence" (a torch whose flash kernel takes no block table: one block per
        sequence), "kernel" (csrc/paged_attention.cu, opt-in), None (the reference: CPU, fp32, a
        head dim flash rejects). VERL_MCORE_PAGED_KERNEL picks one: "triton", "flash" (or "0":
        torch's flash kernel, paged where it can be), "kernel" (or "1")."""
        choice = os.environ.get("VERL_MCORE_PAGED_KERNEL", "").strip().lower()
        choice = {"0": "flash", "1": "kernel"}.get(choice, choice)
        if choice not in ("", "triton", "flash", "kernel"):  # a typo fails on every machine
            raise ValueError(f"NativeEngine: VERL_MCORE_PAGED_KERNEL={choice!r}: use triton, flash (0) or "
                             "kernel (1), or leave it unset")
        net = self.net
        if net.device.type != "cuda":
            return None, "not on a GPU"
        if net.dtype not in (torch.bfloat16, torch.float16):
            return None, f"activation dtype {net.dtype} (flash attention needs bf16/fp16)"
        if net.head_dim % 8 or net.head_dim > 256:
            return None, f"head dim {net.head_dim}"
        shape = (net.device, net.heads, net.groups, net.head_dim, net.dtype)
        if choice in ("", "triton", "kernel"):
            mode, name, check = (("kernel", "csrc/ paged kernel", decode_ops.paged_kernel_supported)
                                 if choice == "kernel" else
                                 ("triton", "Triton paged kernel", decode_ops.paged_triton_supported))
            failed = check(*shape)
            if failed is None:
                return mode, f"the {name}" + (" (VERL_MCORE_PAGED_KERNEL)" if choice else "")
            if choice:
                warnings.warn(f"NativeEngine: VERL_MCORE_PAGED_KERNEL={choice}, but the {name} fails its "
                              f"self-check here ({failed}); torch's flash kernel instead")
        else:
            failed = "VERL_MCORE_PAGED_KERNEL=flash"
        paged = decode_ops.paged_flash_supported(*shape)
        if paged is None:
            return "paged", f"torch's paged flash kernel (the paged kernel: {failed})"
        whole = decode_ops.sequence_flash_supported(*shape)
        if whole is None:
            return "sequence", f"paged kernel: {failed}; paged flash: {paged}: one block per sequence"
        return None, f"paged kernel: {failed}; paged flash: {paged}; per-sequence flash: {whole}"

    @classmethod
    def from_config(cls, rollout_cfg, model: torch.nn.Module, *, vocab_size: int, groups,
                    repartitioner=None) -> "NativeEngine":
        """The engine for `rollout` config settings (max_num_seqs, gpu_memory_utilization,
        keep_weights_buffer) on the generation TP group of `groups`."""
        return cls(model, vocab_size=vocab_size, tp_group=groups.gen_tp, repartitioner=repartitioner,
                   keep_weights_buffer=rollout_cfg.keep_weights_buffer,
                   max_num_seqs=rollout_cfg.max_num_seqs,
                   gpu_memory_utilization=rollout_cfg.gpu_memory_utilization)

    # ---------------------------------------------------------------- weights and memory

    def load_weights(self) -> dict[str, float]:
        if self.repartitioner is None:
            # The model is the training model: its weights are current; an FP8 copy of them is
            # requantized in place (the CUDA graphs read the same addresses).
            if self.fp8_weights is not None:
                self.fp8_weights.refresh()
            return {}
        stats = self.repartitioner.run()
        return {"rollout/repartition_seconds": stats.seconds,
                "rollout/repartition_bytes_received": float(stats.bytes_received),
                "rollout/repartition_bytes_sent": float(stats.bytes_sent),
                "rollout/repartition_min_bytes_received": float(stats.min_bytes_received)}

    @property
    def cache_bytes(self) -> int:
        """Bytes of the KV cache the engine holds now (0 when none)."""
        cache = self.net.cache
        return 0 if cache is None else cache.numel() * cache.element_size()

    def sleep(self) -> None:
        """Give the memory back for training: the KV cache, the CUDA graphs over it and the
        repartition buffer (unless keep_weights_buffer). The cache and its graphs stay when they
        take at most `keep_cache_bytes` and the weights stay where the graphs read them (the
        training model's own, or a kept buffer): the next call then neither allocates nor
        captures again (`kept_bytes` says how much stayed)."""
        weights_stay = (self.repartitioner is None and self.fp8_weights is None) or self.keep_weights_buffer
        self.kept_bytes = self.cache_bytes if weights_stay and self.cache_bytes <= self.keep_cache_bytes else 0
        if self.kept_bytes:
            return
        self._graphs.clear()  # they hold addresses of the cache and the weights
        self._graph_pool = None
        self.net.cache, self.pool = None, None
        if self.repartitioner is not None and not self.keep_weights_buffer:
            self.repartitioner.buffer.release()
        if self.fp8_weights is not None and not self.keep_weights_buffer:
            self.fp8_weights.release()
        if self.net.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if self.repartitioner is not None:
            self.repartitioner.buffer.restore()
        if self.fp8_weights is not None:
            self.fp8_weights.restore()  # refilled by load_weights (the repartition or a refresh)

    def _block_bytes(self) -> int:
        net = self.net
        return (len(net.layers) * 2 * self.block_size * net.groups * net.head_dim
                * torch.empty((), dtype=net.dtype).element_size())

    def _ensure_cache(self, wanted: int, one_sequence: int) -> None:
        """A KV cache of `wanted` blocks (the most this call could hold at once), or fewer where
        the memory budget says so; at least `one_sequence` + the scratch block."""
        if self.pool is not None and (self.pool.num_blocks >= wanted or (
                self._capped and self.pool.num_blocks > one_sequence)):
            # Enough, or all the budget allowed last time: kept (with the CUDA graphs over it).
            self.pool = kv_blocks.BlockPool(self.pool.num_blocks, self.block_size)
            return
        self._drop_cache()
        net = self.net
        if net.device.type == "cuda":
            torch.cuda.empty_cache()  # so the free-memory reading below includes the old cache
        fit = self._blocks_that_fit()
        if self.tp_group is not None:
            # Free memory differs between GPUs: the ranks of a group agree on the smallest fit, so
            # they run the same schedule (same collectives) and refuse together.
            unlimited = 1 << 62
            t = torch.tensor([unlimited if fit is None else fit], dtype=torch.long, device=net.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
            fit = None if int(t.item()) == unlimited else int(t.item())
        blocks = wanted if fit is None else min(wanted, fit)
        self._capped = blocks < wanted
        if blocks < one_sequence + 1:
            raise RuntimeError(
                f"NativeEngine: one sequence of {one_sequence * self.block_size} tokens needs "
                f"{one_sequence * self._block_bytes() / 2**20:.0f} MiB of KV cache, more than "
                f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} of the free GPU "
                "memory (on at least one rank of the generation TP group)")
        self.net.cache = torch.zeros(len(net.layers), 2, blocks, self.block_size, net.groups,
                                     net.head_dim, dtype=net.dtype, device=net.device)
        self.pool = kv_blocks.BlockPool(blocks, self.block_size)

    def _drop_cache(self) -> None:
        self.net.cache, self.pool, self._graphs, self._graph_pool = None, None, {}, None

    def _blocks_that_fit(self) -> Optional[int]:
        """KV blocks within rollout.gpu_memory_utilization of this GPU's free memory; None (no
        limit) off the GPU."""
        if self.net.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.net.device)
        return int(free * self.gpu_memory_utilization) // self._block_bytes()

    def _table_width(self, max_len: int) -> int:
        """Block-table columns for sequences of up to `max_len` tokens: a power of two under CUDA
        graphs (few graphs; the flash kernel reads only each sequence's own blocks)."""
        width = self.pool.blocks_for(max_len)
        return 1 << (width - 1).bit_length() if self.use_graphs else width

    # ---------------------------------------------------------------- forward passes

    def _prefill(self, contexts: list[list[int]], tables: list[list[int]]
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run `contexts` (right-padded, causal) into their blocks `tables`; logits of each
        context's last token [n, V_local] and its routing (`_last_logits`)."""
        net, bs = self.net, self.block_size
        lengths = [len(c) for c in contexts]
        s = max(lengths)
        tokens = torch.zeros(len(contexts), s, dtype=torch.long)
        rows = torch.full((s, len(contexts)), -1, dtype=torch.long)  # [s, n] like k, v below
        for i, (c, blocks) in enumerate(zip(contexts, tables)):
            tokens[i, : len(c)] = torch.as_tensor(c, dtype=torch.long)
            pos = torch.arange(len(c))
            rows[: len(c), i] = torch.as_tensor(blocks, dtype=torch.long)[pos // bs] * bs + pos % bs
        tokens = tokens.to(net.device)
        valid = (rows >= 0).to(net.device)
        rows = rows.to(net.device)[valid]
        positions = torch.arange(s, device=net.device).expand(len(contexts), s)

        def attend(i, q, k, v):
            kc, vc = net.cache_rows(i)
            kc[rows] = k[valid]  # padding positions are not written
            vc[rows] = v[valid]
            # [s, n, heads, hd] -> [n, heads, s, hd]; right padding never reaches a real token
            # under the causal mask.
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=net.scale,
                                                 enable_gqa=net.heads != net.groups)
            return out.permute(2, 0, 1, 3).reshape(s, len(contexts), -1)

        h = net.forward(tokens, positions, attend)  # [s, n, H]
        last = torch.as_tensor(lengths, device=h.device) - 1
        return self._last_logits(h, last)

    def _prefill_cached(self, contexts: list[list[int]], starts: list[int],
                        tables: list[list[int]]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run the tokens of `contexts` from `starts` on (their prefixes' KV already in the
        blocks `tables`) into the cache; logits of each context's last token [n, V_local] and
        its routing (`_last_logits`). The
        queries attend to the cached prefix and, causally, to each other."""
        net, bs = self.net, self.block_size
        n = len(contexts)
        news = [c[a:] for c, a in zip(contexts, starts)]
        sq, sk = max(map(len, news)), max(map(len, contexts))
        tokens = torch.zeros(n, sq, dtype=torch.long)
        positions = torch.zeros(n, sq, dtype=torch.long)
        write = torch.full((sq, n), -1, dtype=torch.long)  # [s, n] like k, v below
        read = torch.zeros(n, sk, dtype=torch.long)  # padding reads the scratch block's row 0
        for i, (new, a, blocks) in enumerate(zip(news, starts, tables)):
            table = torch.as_tensor(blocks, dtype=torch.long)
            pos = torch.arange(a + len(new))
            rows = table[pos // bs] * bs + pos % bs
            tokens[i, : len(new)] = torch.as_tensor(new, dtype=torch.long)
            positions[i, : len(new)] = pos[a:]
            positions[i, len(new):] = pos[-1]  # padding: any position within the rope tables
            write[: len(new), i] = rows[a:]
            read[i, : len(rows)] = rows
        query_pos = positions.unsqueeze(2)  # [n, sq, 1]
        key_pos = torch.arange(sk).view(1, 1, sk)
        lengths = torch.as_tensor([len(c) for c in contexts]).view(n, 1, 1)
        mask = ((key_pos <= query_pos) & (key_pos < lengths)).unsqueeze(1).to(net.device)  # [n, 1, sq, sk]
        tokens, positions = tokens.to(net.device), positions.to(net.device)
        valid = (write >= 0).to(net.device)
        write, read = write.to(net.device)[valid], read.to(net.device)

        def attend(i, q, k, v):
            kc, vc = net.cache_rows(i)
            kc[write] = k[valid]
            vc[write] = v[valid]
            keys, values = (c[read].permute(0, 2, 1, 3) for c in (kc, vc))  # [n, groups, sk, hd]
            out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), keys, values, attn_mask=mask,
                                                 scale=net.scale, enable_gqa=net.heads != net.groups)
            return out.permute(2, 0, 1, 3).reshape(sq, n, -1)

        h = net.forward(tokens, positions, attend)  # [sq, n, H]
        last = torch.as_tensor([len(x) for x in news], device=h.device) - 1
        return self._last_logits(h, last)

    def _last_logits(self, h: torch.Tensor, last: torch.Tensor
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """A prefill's (logits [n, V_local], routing [n, layers, k] or None) at each context's
        last position `last` [n] of its final hidden states h [s, n, H]: what its first sampled
        token comes from."""
        n = h.shape[1]
        rows = torch.arange(n, device=h.device)
        routing = self.net.routing(last * n + rows) if self.routing_shape else None
        return self.net.logits(h[last, rows].unsqueeze(0))[0], routing

    def _decode_forward(self, ds: "_DecodeState") -> torch.Tensor:
        """One token per slot, from the decode state's inputs (last token at position pos, block
        table) -> logits [slots, V_local]. Reads only device tensors: CUDA-graph safe."""
        net = self.net
        b = ds.last.shape[0]
        rows = decode_ops.cache_rows(ds.table, ds.pos, self.block_size)
        seq_lens = (ds.pos + 1).to(torch.int32)

        def paged(i, q):
            return decode_ops.paged_attention(q, net.cache[i, 0], net.cache[i, 1], ds.table, seq_lens,
                                              net.scale, flash=self.attention, cascade=ds.cascade)

        if self.fused:
            h = net.fused_decode(ds.last, ds.pos, rows, paged)
        else:
            def attend(i, q, k, v):
                kc, vc = net.cache_rows(i)
                kc[rows] = k[0]
                vc[rows] = v[0]
                return paged(i, q[0].contiguous()).reshape(1, b, -1)

            h = net.forward(ds.last.unsqueeze(1), ds.pos.unsqueeze(1), attend)
        if ds.out_routing is not None:  # before `advance` moves the column on
            ds.record_routing(net.routing())
        return net.logits(h)[0]

    def _step(self, ds: "_DecodeState") -> None:
        """One decoding step of every slot: forward, sample, stop and length checks, all on the
        device. Under CUDA graphs the whole step is one graph at TP_g = 1; under TP_g > 1 the
        graph holds the forward and the sampler's collectives run after it."""
        if not self.use_graphs:
            return self._sample_step(ds, self._decode_forward(ds))
        if ds.graph is None:
            try:
                self._capture(ds)
            except RuntimeError as e:  # e.g. an op that syncs with the host inside megatron
                warnings.warn(f"NativeEngine: CUDA graph capture failed ({e}); decoding eagerly")
                torch.cuda.synchronize()
                self.use_graphs, self._graphs, self._graph_pool = False, {}, None
                return self._sample_step(ds, self._decode_forward(ds))
        ds.graph.replay()
        if self.tp_group is not None:
            self._sample_step(ds, ds.logits)

    def _sample_step(self, ds: "_DecodeState", logits: torch.Tensor) -> None:
        u = None if ds.sp.greedy else sampling_mod.uniforms_device(ds.keys, ds.gen)
        ds.advance(*self._pick(logits, ds.sp, u))

    def _graph_body(self, ds: "_DecodeState") -> torch.Tensor:
        logits = self._decode_forward(ds)
        if self.tp_group is None:
            self._sample_step(ds, logits)
        return logits

    def _capture(self, ds: "_DecodeState") -> None:
        """Capture the decode step over the decode state's tensors. The warm-up runs on this
        step's real inputs and the state is put back after it: the replay then writes the same
        K/V again and samples this step's tokens."""
        saved = ds.snapshot()
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # lazy initialisations and allocator warm-up outside the capture
                    self._graph_body(ds)
                    ds.restore(saved)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                ds.logits = self._graph_body(ds)
        except RuntimeError:
            torch.cuda.synchronize()
            ds.restore(saved)  # a warm-up that failed half-way must not have advanced the state
            raise
        ds.graph = graph

    def _pick(self, logits_local: torch.Tensor, sp: SamplingParams, u: Optional[torch.Tensor]
              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Tokens [b] (and their log-probs) from vocab-parallel logits [b, V_local] and uniforms
        u [b] (None: greedy), the same on every rank of the TP group; no host sync."""
        if self.tp_group is not None:
            return tp_sampling.sample_vocab_parallel(
                logits_local, sp.temperature, sp.top_p, sp.top_k, u, vocab_size=self.vocab_size,
                group=self.tp_group, logprobs=sp.logprobs)
        return sampling_mod.sample_with_logprobs(logits_local[:, : self.vocab_size], sp.temperature,
                                                 sp.top_p, sp.top_k, u, sp.logprobs)

    # ---------------------------------------------------------------- generation loop

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams
                 ) -> list[SampleOutput]:
        with self._decoding():
            return self._generate(prompt_token_ids, sampling)

    @contextlib.contextmanager
    def _decoding(self):
        """The model as decoding needs it: eval mode, no autograd, no sequence parallelism."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), _sequence_parallel_off(self.model):
                yield
        finally:
            self.model.train(was_training)

    @contextlib.contextmanager
    def serving(self, sampling: SamplingParams, *, max_len: int, sessions: int):
        """A step-wise serving session (rollout/serving.py): requests join and leave between
        decode rounds. max_len: the longest context + new tokens a request may have; sessions:
        the sequences the caller keeps at once (live or holding kept KV), which sizes the cache
        (on a GPU within gpu_memory_utilization: kept KV is then evicted when short)."""
        with self._decoding():
            server = NativeServer(self, sampling, max_len=max_len, sessions=sessions)
            try:
                yield server
            finally:
                server.close()

    def _check_same_call(self, prompts: list[list[int]], sp: SamplingParams) -> None:
        """The ranks of a TP group decode in lockstep: different prompts would hang them in a
        collective. One small all-gather per call turns that into an error on every rank."""
        if self.tp_group is None:
            return
        digest = hashlib.sha1(repr((prompts, sp)).encode()).hexdigest()  # stable across processes
        mine = (digest, len(prompts))
        everyone = [None] * dist.get_world_size(self.tp_group)
        dist.all_gather_object(everyone, mine, group=self.tp_group)
        if any(e != everyone[0] for e in everyone):
            ranks = dist.get_process_group_ranks(self.tp_group)
            raise ValueError(f"NativeEngine.generate: the ranks {ranks} of a generation TP group "
                             f"were given different prompts or sampling parameters (prompt counts "
                             f"{[e[1] for e in everyone]}); every rank of the group must pass the "
                             "same ones")

    def _generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams
                  ) -> list[SampleOutput]:
        sp = sampling
        prompts = [list(map(int, p)) for p in prompt_token_ids]
        self._check_same_call(prompts, sp)  # first: a rank that raised alone would hang the rest
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"NativeEngine.generate: prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"NativeEngine.generate: prompt {i} has token ids outside the "
                                 f"vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if not prompts:
            return []
        start = time.perf_counter()
        max_len = max(map(len, prompts)) + sp.max_new_tokens
        slots = min(self.max_num_seqs, len(prompts) * sp.n)
        width = self._open(max_len, slots, "NativeEngine.generate: prompt + max_new_tokens")
        seed = sp.seed
        if seed is None and not sp.greedy:
            seed = int(torch.randint(0, 2**62, ()).item())
        st = _Schedule(prompts, sp, slots, width, self.pool, seed or 0, self.routing_shape)
        while st.waiting or st.live:
            self._round(st)
        self.last_stats = self._stats(st, time.perf_counter() - start)
        return [st.output(s) for s in range(st.n_seq)]

    def _open(self, max_len: int, sequences: int, what: str) -> int:
        """Ready the cache for `sequences` sequences of up to `max_len` tokens (`what` names the
        length in errors): blocks, rope tables, CUDA graphs still valid. Returns the block-table
        width."""
        max_pos = getattr(self.model, "max_sequence_length", None)
        if max_pos is not None and max_len > max_pos:
            raise ValueError(f"{what} = {max_len} exceeds the model's max_position_embeddings {max_pos}")
        if self.attention == "sequence" and max_len > self.block_size:
            self.block_size = -(-max_len // 256) * 256  # a block holds the longest sequence
            self._drop_cache()
        per_seq = -(-max_len // self.block_size)
        self._ensure_cache(sequences * per_seq + 1, per_seq)
        width = self._table_width(max_len)
        if self.net.rope_tables(width * self.block_size):
            self._graphs.clear()  # graphs hold the old tables' addresses
        weights = tuple(p.data_ptr() for p in self.model.parameters())
        if weights != self._graph_weights:  # moved since the capture (e.g. freed and restored)
            self._graphs.clear()
            self._graph_weights = weights
        return width

    def _round(self, st: "_Schedule") -> None:
        """One round of a schedule: admit waiting sequences, hand out the blocks the round needs,
        decode up to steps_per_sync steps on the device, collect the tokens (finished sequences
        leave their slots)."""
        if st.waiting:
            self._admit(st)
        if not st.live:
            return  # everything admitted finished at its first token
        steps = self._grow(st)
        active = self._active_slots(st, st.slots)
        st.compact(active)
        ds = self._decode_state(active, st.width, st.sp, st.stop_cap, st.grouped)
        ds.load(st)
        for _ in range(steps):
            self._step(ds)
        self._collect(st, ds, steps)

    def _stats(self, st: "_Schedule", seconds: float) -> dict[str, float]:
        occupancy = st.live_slot_steps / max(1, st.stepped_slot_steps)
        return {"rollout/seconds": seconds,
                "rollout/response_tokens": float(sum(map(len, st.tokens))),
                "rollout/prefill_tokens": float(st.prefill_tokens),
                "rollout/decode_steps": float(st.decode_steps),
                "rollout/slots": float(st.slots),
                "rollout/slot_occupancy": occupancy,
                "rollout/live_slot_steps": float(st.live_slot_steps),
                "rollout/stepped_slot_steps": float(st.stepped_slot_steps),
                "rollout/compactions": float(st.compactions),
                "rollout/peak_live_sequences": float(st.peak_live),
                "rollout/kv_blocks": float(self.pool.num_blocks - 1),
                "rollout/kv_block_tokens": float(self.block_size),
                "rollout/kv_peak_blocks_used": float(self.pool.peak_used),
                "rollout/kv_shared_prefix_blocks": float(st.shared_blocks),
                "rollout/preemptions": float(st.preemptions),
                "rollout/prefix_group_rounds": float(st.cascade_rows),
                "rollout/host_syncs": float(st.syncs),
                # 1: decoded in CUDA graphs; 0 off the GPU, with cuda_graphs=False, or
                # after a failed capture (the engine then decodes eagerly)
                "rollout/cuda_graphs": float(self.use_graphs)}

    def _active_slots(self, st: "_Schedule", slots: int) -> int:
        """Slots the next round steps: all of them while sequences wait to be admitted, else the
        smallest power of two (at least min_compact_slots) that holds the live ones."""
        if st.waiting or not self.min_compact_slots:
            return slots
        return min(slots, max(self.min_compact_slots, 1 << (len(st.live) - 1).bit_length()))

    def _decode_state(self, slots: int, width: int, sp: SamplingParams, stop_cap: int,
                      grouped: bool) -> "_DecodeState":
        """The device tensors the decode step reads and writes, kept with its CUDA graph: one per
        batch shape and sampling settings (a graph bakes in the sampler's branches)."""
        # prefix groups form only among sequences sharing a prompt, of at least two a group row
        cascade = self.cascade_members if grouped and self.cascade_members > 1 else 0
        key = (slots, width, sp.temperature, sp.top_p, sp.top_k, sp.logprobs, stop_cap, cascade)
        ds = self._graphs.get(key)
        if ds is None:
            ds = self._graphs[key] = _DecodeState(slots, width, self.steps_per_sync, sp, self.net.device,
                                                  cascade, stop_cap, self.routing_shape)
        ds.sp = sp
        return ds

    def _admit(self, st: "_Schedule") -> None:
        """Prefill waiting sequences into free slots while KV blocks last, and sample their
        first tokens. The fresh samples of a prompt admitted together share its prompt's full
        blocks (prefilled once); a sequence preempted earlier is recomputed from its prompt and
        the tokens it had; a session's continuation keeps the blocks of the prefix its session
        cached and prefills the rest. Kept KV of other sessions is evicted when blocks run out."""
        pool, bs, k = self.pool, self.block_size, self.steps_per_sync
        free = st.free_slots()
        # Blocks the live sequences take in their next round of steps stay free; an admitted one
        # is charged its blocks and its own next round's.
        budget = pool.free - sum(max(0, st.round_need(slot, k)) for slot in st.live)
        groups: list[list[int]] = []  # sequences prefilled together: one context each group
        taken_slots, taken_blocks, prompts_in, longest = 0, 0, 0, 0
        while st.waiting and taken_slots < len(free):
            s = st.waiting[0]
            context = len(st.context(s))
            shares = bool(groups) and st.shares_with(groups[-1][0], s)
            cached, kept, _ = st.reuse_plan(s)
            held = pool.blocks_for(context)
            growth = pool.blocks_for(context + min(k, st.max_new[s] - len(st.tokens[s]) - 1)) - held
            cost = ((1 if context % bs else 0) if shares else held - len(kept)) + growth
            if taken_blocks + cost > budget:
                chosen = {st.sessions[x] for g in groups for x in g} | {st.sessions[s]}
                freed = st.evict(chosen | {st.sessions[x] for x in st.waiting}) or st.evict(chosen)
                if freed:
                    budget += freed
                    continue
                break
            if not shares:
                wider = max(longest, context - cached)
                if groups and (prompts_in + 1) * wider > self.max_prefill_tokens:
                    break
                prompts_in, longest = prompts_in + 1, wider
                groups.append([])
            groups[-1].append(st.waiting.popleft())
            taken_slots, taken_blocks = taken_slots + 1, taken_blocks + cost
        if not groups:
            if not st.live:
                raise RuntimeError(  # _ensure_cache sized the pool for one sequence: a bug if so
                    f"NativeEngine: no KV blocks for sequence {st.waiting[0]} with nothing live")
            return
        heads = []
        for group in groups:
            head = group[0]
            kept = st.take_kept(head)
            st.place(head, free.pop(0), kept + pool.take(pool.blocks_for(len(st.context(head))) - len(kept)))
            heads.append(head)
        logits, routing = self._prefill_heads(st, heads)
        copies = []  # (source block, destination block): each sample's own partial prompt block
        for group in groups:
            head_blocks = st.blocks[st.slot_of[group[0]]]
            context = len(st.context(group[0]))
            full = context // bs
            for s in group[1:]:
                pool.share(head_blocks[:full])
                own = pool.take(len(head_blocks) - full)
                copies += zip(head_blocks[full:], own)
                st.place(s, free.pop(0), head_blocks[:full] + own)
                st.shared_blocks += full
        if copies:
            src, dst = (torch.as_tensor(c, device=self.net.device) for c in zip(*copies))
            self.net.cache[:, :, dst] = self.net.cache[:, :, src]
        admitted = [s for group in groups for s in group]
        rows = torch.as_tensor([i for i, group in enumerate(groups) for _ in group], device=logits.device)
        u = None if st.sp.greedy else sampling_mod.uniforms_device(
            st.keys_of(admitted, logits.device), torch.as_tensor(
                [st.draws[s] + len(st.tokens[s]) for s in admitted], dtype=torch.long, device=logits.device))
        toks, lps = self._pick(logits[rows], st.sp, u)
        st.record_first(admitted, toks.tolist(), None if lps is None else lps.tolist(),
                        None if routing is None else routing[rows].cpu().numpy())

    def _prefill_heads(self, st: "_Schedule", heads: list[int]
                       ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits [len(heads), V_local] of each head's last context token (and its routing
        [len(heads), layers, k] when recorded), its context written into its blocks: whole
        contexts in one forward, continuations of a cached prefix (their `cached` tokens already
        in the blocks) in another."""
        starts = [st.cached.pop(s, 0) for s in heads]
        st.prefill_tokens += sum(len(st.context(s)) - c for s, c in zip(heads, starts))
        st.reused_tokens += sum(starts)
        whole = [i for i, c in enumerate(starts) if not c]
        if len(whole) == len(heads):
            return self._prefill([st.context(s) for s in heads], [st.blocks[st.slot_of[s]] for s in heads])
        rest = [i for i, c in enumerate(starts) if c]
        parts = [(rest, self._prefill_cached([st.context(heads[i]) for i in rest], [starts[i] for i in rest],
                                             [st.blocks[st.slot_of[heads[i]]] for i in rest]))]
        if whole:
            parts.append((whole, self._prefill([st.context(heads[i]) for i in whole],
                                               [st.blocks[st.slot_of[heads[i]]] for i in whole])))
        order = torch.as_tensor([i for idx, _ in parts for i in idx]).argsort()
        logits = torch.cat([lg for _, (lg, _) in parts])[order.to(parts[0][1][0].device)]
        if not self.routing_shape:
            return logits, None
        return logits, torch.cat([r for _, (_, r) in parts])[order.to(logits.device)]

    def _grow(self, st: "_Schedule") -> int:
        """Decoding steps for the next round, with KV blocks for every live sequence's tokens in
        it; when blocks run out, kept KV of finished sessions is evicted, then the most recently
        admitted sequences are preempted (their blocks freed, to be recomputed when readmitted)."""
        while True:
            steps = min(self.steps_per_sync, max(st.remaining(s) for s in st.live))
            wants = {slot: st.round_need(slot, steps) for slot in st.live}
            if sum(max(0, w) for w in wants.values()) <= self.pool.free:
                break
            # Kept KV goes before live work: that of sessions with nothing waiting first.
            if st.evict({st.sessions[s] for s in st.waiting}) or st.evict(set()):
                continue
            if len(st.live) == 1:
                raise RuntimeError("NativeEngine: one live sequence outgrew the KV cache "
                                   "(the pool was sized for it: a bug)")
            st.preempt(max(st.live, key=lambda slot: st.admitted_at[slot]))
        for slot, w in wants.items():
            if w > 0:
                st.add_blocks(slot, self.pool.take(w))
        return steps

    def _collect(self, st: "_Schedule", ds: "_DecodeState", steps: int) -> None:
        """The host's look after `steps` decoding steps: new tokens, finished sequences."""
        toks = ds.out_tokens[:, :steps].cpu().numpy()
        lps = ds.out_logprobs[:, :steps].cpu().numpy() if st.sp.logprobs else None
        routing = ds.out_routing[:, :steps].cpu().numpy() if ds.out_routing is not None else None
        st.syncs += 1
        st.decode_steps += steps
        st.stepped_slot_steps += steps * ds.slots
        for slot in list(st.live):
            row = toks[slot]
            n = int(np.argmax(row < 0)) if (row < 0).any() else steps
            st.live_slot_steps += n
            st.extend(slot, row[:n].tolist(), None if lps is None else lps[slot, :n].tolist(),
                      None if routing is None else routing[slot, :n])


class NativeServer(serving.Server):
    """A serving session of the native engine (rollout/serving.py; `NativeEngine.serving` opens
    it): requests are sequences of one schedule, which each `step` runs one round of, as
    `generate` runs its own until every sequence finished."""

    def __init__(self, engine: NativeEngine, sampling: SamplingParams, *, max_len: int, sessions: int):
        if sessions < 1:
            raise ValueError(f"NativeEngine.serving: sessions must be >= 1, got {sessions}")
        self.engine, self.sp, self.max_len = engine, sampling, max_len
        slots = min(engine.max_num_seqs, sessions)
        width = engine._open(max_len, max(slots, sessions), "NativeEngine.serving: max_len")
        self.st = _Schedule([], sampling, slots, width, engine.pool, 0, engine.routing_shape)
        self.start = time.perf_counter()

    def submit(self, request: serving.Request) -> int:
        sp = self.sp
        if request.max_new_tokens is None or request.stop_token_ids is None:
            request = dataclasses.replace(
                request, max_new_tokens=request.max_new_tokens or sp.max_new_tokens,
                stop_token_ids=sp.stop_token_ids if request.stop_token_ids is None else request.stop_token_ids)
        serving.check_request(request, self.engine.vocab_size, self.max_len,
                              f"NativeEngine.serving: request {self.st.n_seq}")
        return self.st.add(list(request.token_ids), request.key, request.draws, request.max_new_tokens,
                           request.stop_token_ids, request.session, request.share,
                           (request.prompt_index, request.sample_index))

    def step(self) -> list[tuple[int, SampleOutput]]:
        st = self.st
        if st.waiting or st.live:
            self.engine._round(st)
        done, st.done = st.done, []
        return [(s, st.output(s)) for s in done]

    @property
    def busy(self) -> bool:
        return bool(self.st.waiting or self.st.live)

    def release(self, session) -> None:
        self.st.release(session)

    def abort(self) -> list[tuple[int, SampleOutput]]:
        # Between rounds the host holds every token the device sampled (_collect), so the
        # outputs are complete up to the last round.
        return [(s, self.st.output(s)) for s in self.st.abort()]

    def stats(self) -> dict[str, float]:
        st = self.st
        return {**self.engine._stats(st, time.perf_counter() - self.start),
                "rollout/kv_reused_tokens": float(st.reused_tokens),
                "rollout/kv_kept_evictions": float(st.evictions),
                "rollout/kv_kept_sessions": float(len(st.kept))}

    def close(self) -> None:
        """Every kept session's KV back to the pool; the engine's last_stats are the session's."""
        for session in list(self.st.kept):
            self.st.release(session)
        self.engine.last_stats = self.stats()


def _stop_capacity(n: int) -> int:
    """Stop ids are held in a tensor of a power-of-two size (padded with -1): few graph shapes."""
    return 1 << max(0, n - 1).bit_length() if n else 0


class _DecodeState:
    """Device tensors of the decode loop, per slot: the token fed next (`last`) at position `pos`,
    whether the slot decodes a live sequence, its random stream's counter (`gen`: the draws of
    its request before it and the tokens it has) and the counter's limit (`limit`: where its
    max_new_tokens run out), its random key, stop ids and block table row; the round's sampled
    tokens and log-probs (column `col`, one per step) until the host collects them, and with
    `routing_shape` (layers, k) the experts each step's forward chose per slot. The CUDA graph
    of the decode step reads and writes these tensors in place."""

    def __init__(self, slots: int, width: int, steps: int, sp: SamplingParams, device: torch.device,
                 cascade_members: int = 0, stop_cap: int = 0,
                 routing_shape: Optional[tuple[int, int]] = None):
        z = dict(device=device, dtype=torch.long)
        self.slots = slots
        self.last, self.pos, self.gen, self.keys, self.limit = (torch.zeros(slots, **z) for _ in range(5))
        self.alive = torch.zeros(slots, dtype=torch.bool, device=device)
        self.table = torch.zeros(slots, width, dtype=torch.int32, device=device)
        self.out_tokens = torch.full((slots, steps), -1, **z)
        self.out_logprobs = torch.zeros(slots, steps, dtype=torch.float32, device=device)
        # [slots, steps, layers, k]: the routing of the forward that produced each step's token
        self.out_routing = None if routing_shape is None else torch.full(
            (slots, steps, *routing_shape), -1, dtype=torch.int32, device=device)
        self.col = torch.zeros(1, **z)
        # each row sorted and padded with its largest id (-1 throughout for a slot without any)
        self.stop_ids = torch.full((slots, stop_cap), -1, **z) if stop_cap else None
        # shared prompt prefixes (`_Schedule.prefix_groups`), when the attention reads them once
        self.cascade = None if not cascade_members else tuple(
            torch.zeros(shape, dtype=torch.int32, device=device)
            for shape in ((slots, cascade_members), (slots,), (slots,)))
        self.sp = sp
        self.graph, self.logits = None, None

    def load(self, st: "_Schedule") -> None:
        """The host's view of this state's slots (the schedule's first `slots`: live sequences
        sit there), copied in after admissions, growth and collection."""
        pairs = [(self.last, st.last), (self.pos, st.pos), (self.gen, st.gen), (self.keys, st.slot_keys),
                 (self.limit, st.limit), (self.alive, st.alive), (self.table, st.table)]
        if self.stop_ids is not None:
            pairs.append((self.stop_ids, st.stop_rows))
        if self.cascade is not None:
            st.prefix_groups(self.cascade[0].shape[1])
            pairs += zip(self.cascade, (st.members, st.plen, st.first))
        for dst, src in pairs:
            dst.copy_(torch.from_numpy(src[: self.slots]))
        self.out_tokens.fill_(-1)
        self.col.zero_()

    def _state(self) -> list[torch.Tensor]:
        return [self.last, self.pos, self.gen, self.alive, self.out_tokens, self.out_logprobs, self.col]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self._state()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._state(), saved):
            t.copy_(s)

    def record_routing(self, routing: torch.Tensor) -> None:
        """This step's routing [slots, layers, k] into column `col` (on the device: no sync)."""
        self.out_routing.index_copy_(1, self.col, routing.unsqueeze(1))

    def advance(self, tokens: torch.Tensor, logprobs: Optional[torch.Tensor]) -> None:
        """A step's sampled tokens: record them for live slots, then end the sequences that
        sampled a stop token or reached max_new_tokens; the rest feed their token next."""
        live = self.alive
        at = self.col.expand(live.shape[0]).unsqueeze(1)
        self.out_tokens.scatter_(1, at, torch.where(live, tokens, -1).unsqueeze(1))
        if logprobs is not None:
            self.out_logprobs.scatter_(1, at, logprobs.float().unsqueeze(1))
        self.col += 1
        self.gen += live.long()
        done = self.gen >= self.limit
        if self.stop_ids is not None:  # sorted rows: a binary search (torch.isin syncs: unique)
            at = torch.searchsorted(self.stop_ids, tokens.unsqueeze(1)).clamp_(max=self.stop_ids.shape[1] - 1)
            done |= self.stop_ids.gather(1, at).squeeze(1) == tokens
        live &= ~done
        self.last.copy_(torch.where(live, tokens, self.last))
        self.pos += live.long()


class _Schedule:
    """Host-side state of one generate call or serving session: the sequences (each a context,
    a random stream, a token budget, stop ids), which sits in which slot with which KV blocks,
    each slot's next input token and position, what each sequence has produced, and the KV that
    finished sessions keep for their next request. generate's sequence s is sample s % n of
    prompt s // n."""

    def __init__(self, prompts: list[list[int]], sp: SamplingParams, slots: int, width: int,
                 pool: kv_blocks.BlockPool, seed: int,
                 routing_shape: Optional[tuple[int, int]] = None):
        self.sp, self.pool, self.slots, self.width = sp, pool, slots, width
        self.routing_shape = routing_shape  # (layers, k) when the engine records routing
        self.n_seq = 0
        # Per sequence.
        self.contexts: list[list[int]] = []  # what its prefill reads before its own tokens
        self.keys: list[int] = []  # its random stream's key (int64 bits)
        self.draws: list[int] = []  # the stream's counter before its first token
        self.max_new: list[int] = []
        self.stops: list[frozenset] = []
        self.stop_sorted: list[list[int]] = []
        self.sessions: list = []  # the session keeping its KV when it finishes (None: none)
        self.share: list = []  # its share group (sequences of one prompt: generate's prompt index)
        self.index: list[tuple[int, int]] = []  # (prompt_index, sample_index) of its output
        self.tokens: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.routing: list[list[np.ndarray]] = []  # per token run: [n, layers, k] int32
        self.finish: list[Optional[str]] = []
        self.waiting: deque = deque()
        self.cached: dict[int, int] = {}  # sequence -> prefix tokens its admission found cached
        self.kept: OrderedDict = OrderedDict()  # session -> (cached tokens, blocks), oldest first
        self.done: list[int] = []  # sequences finished since the server last looked
        self.grouped = False  # two sequences of one share group were added
        self._groups: set = set()
        self.slot_seq = [-1] * slots  # sequence held by each slot (-1: free)
        self.slot_of: dict[int, int] = {}
        self.live: list[int] = []  # slots holding a live sequence, in admission order
        self.admitted_at = np.zeros(slots, dtype=np.int64)
        self.blocks: list[list[int]] = [[] for _ in range(slots)]
        # Mirrors of the decode state (`_DecodeState.load` copies them in).
        self.last = np.zeros(slots, dtype=np.int64)  # the token fed at the next step
        self.pos = np.zeros(slots, dtype=np.int64)  # its position
        self.gen = np.zeros(slots, dtype=np.int64)
        self.limit = np.zeros(slots, dtype=np.int64)
        self.slot_keys = np.zeros(slots, dtype=np.int64)
        self.alive = np.zeros(slots, dtype=bool)
        self.table = np.full((slots, width), kv_blocks.SCRATCH, dtype=np.int32)
        self.stop_cap = 0
        self.stop_rows = np.full((slots, 0), -1, dtype=np.int64)
        # Shared prompt prefixes this round (`prefix_groups`; read by the Triton paged kernel).
        self.members = np.full((slots, 1), -1, dtype=np.int32)
        self.plen = np.zeros(slots, dtype=np.int32)
        self.first = np.zeros(slots, dtype=np.int32)
        self.cascade_rows = 0
        self.prefill_tokens = self.decode_steps = self.live_slot_steps = self.syncs = 0
        self.stepped_slot_steps = self.compactions = self.reused_tokens = self.evictions = 0
        self.shared_blocks = self.preemptions = self.peak_live = self._admissions = 0
        if prompts:
            n = sp.n
            keys = sampling_mod.sequence_keys(seed, np.repeat(np.arange(len(prompts)), n),
                                              np.tile(np.arange(n), len(prompts))).view(np.int64)
            stops = tuple(sp.stop_token_ids)
            for s in range(len(prompts) * n):
                self.add(prompts[s // n], int(keys[s]), 0, sp.max_new_tokens, stops, None, s // n,
                         (s // n, s % n))

    def add(self, context: list[int], key: int, draws: int, max_new: int, stops: Sequence[int],
            session, share, index: tuple[int, int]) -> int:
        """A sequence waiting last in line; returns its id."""
        s = self.n_seq
        self.n_seq += 1
        self.contexts.append(context)
        self.keys.append(key)
        self.draws.append(draws)
        self.max_new.append(max_new)
        self.stops.append(frozenset(stops))
        self.stop_sorted.append(sorted(set(stops)))
        self.sessions.append(session)
        self.share.append(share)
        self.index.append(index)
        self.tokens.append([])
        self.logprobs.append([])
        self.routing.append([])
        self.finish.append(None)
        self.waiting.append(s)
        if share is not None:
            self.grouped |= share in self._groups
            self._groups.add(share)
        cap = _stop_capacity(len(self.stop_sorted[s]))
        if cap > self.stop_cap:  # wider stop rows: rewrite the held slots' rows
            self.stop_cap = cap
            self.stop_rows = np.full((len(self.slot_seq), cap), -1, dtype=np.int64)
            for slot in self.slot_of.values():
                self._stop_row(slot)
        return s

    def output(self, s: int) -> SampleOutput:
        p, j = self.index[s]
        extras = {}
        if self.routing_shape is not None:
            extras["routed_experts"] = np.concatenate(
                [np.zeros((0, *self.routing_shape), dtype=np.int32), *self.routing[s]])
        return SampleOutput(prompt_index=p, sample_index=j, token_ids=self.tokens[s],
                            logprobs=self.logprobs[s] if self.sp.logprobs else None,
                            finish_reason=self.finish[s], extras=extras)

    def context(self, s: int) -> list[int]:
        """What sequence s's prefill reads: its context and the tokens it already has (those of a
        preempted sequence)."""
        return self.contexts[s] + self.tokens[s]

    def fresh(self, s: int) -> bool:
        return not self.tokens[s]

    def shares_with(self, head: int, s: int) -> bool:
        """Whether fresh sequence s, admitted right after `head`, shares head's prompt blocks."""
        return (self.share[s] is not None and self.share[s] == self.share[head] and self.fresh(s)
                and self.fresh(head) and self.contexts[s] == self.contexts[head]
                and self.sessions[s] not in self.kept and self.sessions[head] not in self.kept)

    def remaining(self, slot: int) -> int:
        s = self.slot_seq[slot]
        return self.max_new[s] - len(self.tokens[s])

    def round_need(self, slot: int, steps: int) -> int:
        """Blocks a live slot lacks for its next `steps` decoding steps (it feeds at most its
        remaining tokens, at positions pos, pos + 1, ...); <= 0 when it holds enough."""
        fed = min(steps, self.remaining(slot))
        return self.pool.blocks_for(int(self.pos[slot]) + fed) - len(self.blocks[slot])

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slot_seq) if s < 0]

    def keys_of(self, seqs: list[int], device) -> torch.Tensor:
        return torch.as_tensor([self.keys[s] for s in seqs], dtype=torch.long, device=device)

    # ------------------------------------------------------------ KV kept by sessions

    def reuse_plan(self, s: int) -> tuple[int, list[int], list[int]]:
        """(prefix tokens, blocks) that sequence s's admission would keep of its session's
        cached KV, and the blocks it would drop: the common prefix of the cached tokens and its
        context (at least one token left to prefill, for its logits), the blocks wholly inside
        it, and the one it ends in where s is its only holder (a shared one is not written to:
        the prefix then ends at the block boundary)."""
        entry = self.kept.get(self.sessions[s]) if self.sessions[s] is not None and self.fresh(s) else None
        if entry is None:
            return 0, [], []
        cached, blocks = entry
        ctx = self.contexts[s]
        common = next((i for i, (a, b) in enumerate(zip(cached, ctx)) if a != b), min(len(cached), len(ctx)))
        common = min(common, len(ctx) - 1)
        bs = self.pool.block_size
        full = common // bs
        if common % bs and self.pool.refs[blocks[full]] == 1:
            keep = blocks[: full + 1]
        else:
            common, keep = full * bs, blocks[:full]
        return common, keep, blocks[len(keep):]

    def take_kept(self, s: int) -> list[int]:
        """Sequence s's admission takes its session's kept KV (`reuse_plan`): the blocks it keeps
        (its prefix then prefills no more, `cached`); the rest go back to the pool."""
        common, keep, drop = self.reuse_plan(s)
        session = self.sessions[s]
        if session in self.kept:
            del self.kept[session]
            self.pool.release(drop)
        if common:
            self.cached[s] = common
        return keep

    def evict(self, exclude: set) -> int:
        """Drop kept KV of sessions not in `exclude`, oldest first, until some blocks come free;
        returns how many did (0: nothing left to drop)."""
        before = self.pool.free
        for session in [x for x in self.kept if x not in exclude]:
            _, blocks = self.kept.pop(session)
            self.pool.release(blocks)
            self.evictions += 1
            if self.pool.free > before:
                break
        return self.pool.free - before

    def release(self, session) -> None:
        entry = self.kept.pop(session, None)
        if entry is not None:
            self.pool.release(entry[1])

    def abort(self) -> list[int]:
        """Every waiting and live sequence ends "aborted" with the tokens it has; the live ones'
        slots and blocks go back to the pool. Returns their ids, in id order."""
        ended = sorted([*self.waiting, *(self.slot_seq[slot] for slot in self.live)])
        self.waiting.clear()
        for slot in list(self.live):
            self._vacate(slot)
        for s in ended:
            self.finish[s] = "aborted"
            self.cached.pop(s, None)
        return ended

    # ------------------------------------------------------------ slots

    def place(self, s: int, slot: int, blocks: list[int]) -> None:
        self.slot_seq[slot], self.slot_of[s], self.blocks[slot] = s, slot, []
        self.add_blocks(slot, blocks)
        self.admitted_at[slot] = self._admissions
        self._admissions += 1

    def _stop_row(self, slot: int) -> None:
        ids = self.stop_sorted[self.slot_seq[slot]]
        self.stop_rows[slot] = (ids + ids[-1:] * (self.stop_cap - len(ids))) if ids else -1

    def record_first(self, seqs: list[int], toks: list[int], lps: Optional[list[float]],
                     routing: Optional[np.ndarray] = None) -> None:
        """Admitted sequences' first sampled tokens (from their prefill's last logits), with
        that position's routing [len(seqs), layers, k] when recorded."""
        for j, s in enumerate(seqs):
            slot = self.slot_of[s]
            self.live.append(slot)
            self.slot_keys[slot] = self.keys[s]
            self.limit[slot] = self.draws[s] + self.max_new[s]
            if self.stop_cap:
                self._stop_row(slot)
            self.pos[slot] = len(self.context(s))  # the position of the token fed next
            self.extend(slot, [toks[j]], None if lps is None else [lps[j]],
                        None if routing is None else routing[j:j + 1])
        self.peak_live = max(self.peak_live, len(self.live))

    def extend(self, slot: int, toks: list[int], lps: Optional[list[float]],
               routing: Optional[np.ndarray] = None) -> None:
        """Append a slot's new tokens (the device stopped recording after a final one), their
        log-probs and routing [n, layers, k]; retire a finished sequence, or mirror where the
        device state stands."""
        s = self.slot_seq[slot]
        self.tokens[s] += toks
        if lps is not None:
            self.logprobs[s] += lps
        if routing is not None:
            self.routing[s].append(routing.copy())
        t = self.tokens[s][-1]
        if t in self.stops[s]:
            self.finish[s] = "stop"
        elif len(self.tokens[s]) >= self.max_new[s]:
            self.finish[s] = "length"
        if self.finish[s] is not None:
            self._retire(slot)
            return
        if self.alive[slot]:  # a decoding slot (not one just admitted): it fed these tokens
            self.pos[slot] += len(toks)  # fed tokens (the one just sampled is fed next)
        self.alive[slot] = True
        self.last[slot] = t
        self.gen[slot] = self.draws[s] + len(self.tokens[s])

    def _retire(self, slot: int) -> None:
        """A finished sequence leaves its slot; with a session its KV stays (its context and
        every token but the last, which was never fed), replacing what the session kept."""
        s = self.slot_seq[slot]
        session = self.sessions[s]
        if session is not None:
            cached = self.context(s)[:-1]
            held = self.blocks[slot]
            need = self.pool.blocks_for(len(cached))
            self.pool.release(held[need:])
            self.release(session)
            self.kept[session] = (cached, held[:need])
            self.blocks[slot] = []  # now the session's
        self._vacate(slot)
        self.done.append(s)

    def prefix_groups(self, n_max: int) -> None:
        """This round's prefix groups: decoding slots whose first block is shared (the samples of
        a prompt admitted together) and the leading blocks they all hold, in rows of at most
        n_max members -- `members` [slots, n_max] (-1 padded), `plen` (the shared keys) per row,
        `first` (where a slot's own keys start) per slot. Only full prompt blocks are shared, so
        a group's keys lie before every member's position."""
        if self.members.shape[1] != n_max:
            self.members = np.full((len(self.slot_seq), n_max), -1, dtype=np.int32)
        self.members.fill(-1)
        self.plen.fill(0)
        self.first.fill(0)
        buckets: dict[int, list[int]] = {}
        for slot in self.live:
            held = self.blocks[slot]
            if self.alive[slot] and held and self.pool.refs[held[0]] > 1:
                buckets.setdefault(held[0], []).append(slot)
        row = 0
        for slots in buckets.values():
            lead = self.blocks[slots[0]]
            common = len(lead)
            for slot in slots[1:]:
                other = self.blocks[slot]
                common = min(common, next((i for i, (x, y) in enumerate(zip(lead, other)) if x != y),
                                          min(len(lead), len(other))))
            keys = common * self.pool.block_size
            for i in range(0, len(slots), n_max):
                chunk = slots[i:i + n_max]
                if len(chunk) < 2 or keys == 0:
                    continue  # nothing read once for several
                self.members[row, :len(chunk)] = chunk
                self.plen[row] = keys
                self.first[chunk] = keys
                row += 1
        self.cascade_rows += row

    def compact(self, n: int) -> None:
        """Move the live sequences of slots n and up into free slots below n (n >= the live
        count). Only the host's bookkeeping moves: a sequence's KV stays in its blocks, which
        its table row names wherever it sits; its random stream is keyed by the sequence."""
        free = [slot for slot in range(n) if self.slot_seq[slot] < 0]
        moved = False
        for i, slot in enumerate(self.live):
            if slot < n:
                continue
            to = free.pop(0)
            s = self.slot_seq[slot]
            self.slot_seq[to], self.slot_of[s], self.blocks[to] = s, to, self.blocks[slot]
            for a in (self.table, self.last, self.pos, self.gen, self.limit, self.slot_keys, self.alive,
                      self.admitted_at, self.stop_rows):
                a[to] = a[slot]
            self._clear(slot)
            self.live[i] = to
            moved = True
        self.compactions += moved

    def add_blocks(self, slot: int, blocks: list[int]) -> None:
        held = len(self.blocks[slot])
        self.blocks[slot] += blocks
        self.table[slot, held: held + len(blocks)] = blocks

    def preempt(self, slot: int) -> None:
        """Free a live sequence's slot and blocks; it waits first in line, to be recomputed."""
        s = self.slot_seq[slot]
        self._vacate(slot)
        self.waiting.appendleft(s)
        self.preemptions += 1

    def _vacate(self, slot: int) -> None:
        self.pool.release(self.blocks[slot])
        del self.slot_of[self.slot_seq[slot]]
        if slot in self.live:
            self.live.remove(slot)
        self._clear(slot)

    def _clear(self, slot: int) -> None:
        """A free slot: no sequence, no blocks, nothing to read (its table row is the scratch
        block's)."""
        self.blocks[slot] = []
        self.slot_seq[slot] = -1
        self.alive[slot] = False
        self.pos[slot] = self.gen[slot] = self.last[slot] = self.limit[slot] = 0
        self.stop_rows[slot] = -1
        self.table[slot] = kv_blocks.SCRATCH
