"""The native generation engine: the generation-layout megatron GPTModel with a KV cache.

The engine drives the model's own megatron submodules one layer at a time, so tensor-parallel
communication stays inside megatron's parallel linears and the weights are exactly the ones the
repartition wrote (or the training model's, when the layouts agree):

    embedding -> per layer: input_layernorm, linear_qkv -> q, k, v (megatron's group-interleaved
    layout) -> q/k layernorm -> RoPE (the model's own inv_freq) -> cached attention -> linear_proj;
    pre_mlp_layernorm, mlp -> final_layernorm -> output_layer (vocab-parallel logits)

Continuous batching: `max_num_seqs` slots share one KV cache, [layers, 2, slots, len, groups, hd]
("token-major", what the flash kernel reads) on the fused path, [layers, 2, slots, groups, len, hd]
otherwise (what the batched matmuls of the unfused attention read without copies).
Waiting sequences are prefilled into free slots (the n samples of a prompt are prefilled once and
their cache rows copied), then every decoding step advances all slots by one token; a sequence that
samples a stop token or reaches max_new_tokens frees its slot for the next waiting one. Each slot
has its own position and cache length; attention masks keys beyond a slot's length.

Sampling: `sampling.sample` picks tokens with counter-based random numbers from the logits of the
real vocabulary (padding ids >= it cut). Under TP_g > 1 the vocab-parallel logits are not gathered:
`tp_sampling.sample_vocab_parallel` draws from the shards the tokens `sample` would draw (up to float
rounding at CDF boundaries), exchanging a few numbers per sequence within the generation TP group;
every rank of the group gets the same tokens.

On CUDA the decode step (embedding .. logits) is captured in CUDA graphs: small-batch decoding is
otherwise dominated by per-kernel launch overhead. With the csrc/ extension the step also runs
fused kernels (verl_mcore/ops/decode.py: residual add + RMSNorm, rotary + KV-cache write) and
flash attention over the cache with per-sequence key counts (`seqused_k`), so one graph serves
every length and attention reads only the keys each sequence has. Without them (CPU, or a model
the fused path does not cover) attention masks a length bucket of the cache, one graph per bucket.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import time
import warnings
from collections import deque
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_mcore.ops import decode as decode_ops
from verl_mcore.rollout import sampling as sampling_mod
from verl_mcore.rollout import tp_sampling
from verl_mcore.rollout.base import RolloutEngine, SampleOutput, SamplingParams

# Attention over the cache covers a multiple of this many positions (CUDA graph buckets).
_ATTN_BUCKET = 256


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
    """The layer-by-layer forward of a megatron GPTModel with a slot-indexed KV cache."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
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
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self._rope_len = 0
        self._cos = self._sin = None

    def rope_tables(self, length: int) -> None:
        """cos/sin [length, hd] in the activation dtype, from the model's inv_freq (which
        models/rope.py may have replaced, e.g. for Llama-3 scaling)."""
        if length <= self._rope_len:
            return
        inv_freq = self.model.rotary_pos_emb.inv_freq.to(self.device, torch.float32)
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        self._rope_len = length

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [s, b, 1, hd] of positions [b, s], gathered once per forward for every layer."""
        return (self._cos[positions].transpose(0, 1).unsqueeze(2),
                self._sin[positions].transpose(0, 1).unsqueeze(2))

    def _qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [s, b, H] (normed) -> q [s, b, nh, hd], k/v [s, b, ng, hd], RoPE applied."""
        attn = layer.self_attention
        s, b = x.shape[0], x.shape[1]
        mixed, _ = attn.linear_qkv(x)  # bias (if any) is added inside: skip_bias_add=False
        r = self.heads // self.groups
        mixed = mixed.view(s, b, self.groups, (r + 2) * self.head_dim)
        q, k, v = torch.split(mixed, [r * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(s, b, self.heads, self.head_dim)
        if attn.q_layernorm is not None:
            q = attn.q_layernorm(q)
        if attn.k_layernorm is not None:
            k = attn.k_layernorm(k)
        return decode_ops.rotary(q, cos, sin), decode_ops.rotary(k, cos, sin), v

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
            h = self._add(h, layer.self_attention.linear_proj(attend(i, q, k, v)))
            h = self._add(h, layer.mlp(layer.pre_mlp_layernorm(h)))
        return self.final_norm(h)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        h = self.model.decoder.final_layernorm(h)
        return h.to(self.dtype) if self.fp32_residual else h

    # ------------------------------------------------------------ the fused decode step

    def fused_decode_supported(self) -> Optional[str]:
        """None when `fused_decode` can run this model on this device, else why not."""
        if not decode_ops.available(next(self.model.parameters())):
            return "the CUDA extension is not loaded (or the model is not on a GPU)"
        if self.dtype not in (torch.bfloat16, torch.float16):
            return f"activation dtype {self.dtype} (flash attention needs bf16/fp16)"
        if self.head_dim % 8 or self.head_dim > 256:
            return f"head dim {self.head_dim}"
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
                    getattr(layer.mlp.linear_fc2, "bias", None) is not None:
                return "biases on the attention output or MLP output projection"
            norms += [layer.input_layernorm, layer.pre_mlp_layernorm]
        for norm in norms:
            params = _rmsnorm_params(norm)
            if params is None:
                return f"norm module {type(norm).__name__} (no weight / eps)"
            if params[0].dtype != self.dtype:
                return f"norm weight dtype {params[0].dtype} differs from the activations' {self.dtype}"
        try:
            decode_ops.check_cache_attention(self.device, self.dtype, self.heads, self.groups,
                                             self.head_dim)
        except Exception as e:  # noqa: BLE001 - any failure means: use the unfused path
            return f"flash attention over the KV cache is unavailable here ({e})"
        return None

    def fused_decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor
                     ) -> torch.Tensor:
        """One token per slot through the fused kernels: tokens/positions [b] -> final hidden
        [1, b, H]. Keys of slot t are cache positions 0..positions[t] (this token's included)."""
        b = tokens.shape[0]
        r = self.heads // self.groups
        h = self.model.embedding(input_ids=tokens.unsqueeze(1), position_ids=None).contiguous()
        delta = None
        for i, layer in enumerate(self.layers):
            x = decode_ops.rmsnorm(h, delta, *_rmsnorm_params(layer.input_layernorm))
            mixed, _ = layer.self_attention.linear_qkv(x)
            kc, vc = cache[i, 0], cache[i, 1]
            q = decode_ops.rope_cache(mixed.view(b, -1), self._cos, self._sin, positions, kc, vc,
                                      self.groups, r, self.head_dim)
            out = decode_ops.cache_attention(q, kc, vc, positions, self.scale)
            delta, _ = layer.self_attention.linear_proj(out.view(1, b, self.heads * self.head_dim))
            x = decode_ops.rmsnorm(h, delta, *_rmsnorm_params(layer.pre_mlp_layernorm))
            delta, _ = layer.mlp(x)
        return decode_ops.rmsnorm(h, delta, *_rmsnorm_params(self.model.decoder.final_layernorm))

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
    max_num_seqs: decoding slots. gpu_memory_utilization: on CUDA, the KV cache takes at most this
        fraction of the free memory (fewer slots if needed). cuda_graphs: capture the decode step.
    max_prefill_tokens: tokens (prompts x the longest of them, as padded) prefilled in one forward
        (bounds activation memory); one prompt is always admitted, whatever its length.
    fused_decode: decode with the fused kernels and flash attention where supported
        (`fused_decode_reason` says why not, when not).
    """

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, tp_group=None,
                 repartitioner=None, keep_weights_buffer: bool = False, max_num_seqs: int = 256,
                 gpu_memory_utilization: float = 0.5, cuda_graphs: bool = True,
                 max_prefill_tokens: int = 16384, fused_decode: bool = True):
        while not hasattr(model, "decoder") and hasattr(model, "module"):
            model = model.module  # DDP / Float16Module wrappers of the training model
        self.net = _CachedGPT(model)
        self.model = model
        self.vocab_size = vocab_size
        padded = model.vocab_size if hasattr(model, "vocab_size") else None
        if padded is not None and vocab_size > padded:
            raise ValueError(f"NativeEngine: vocab_size {vocab_size} exceeds the model's padded "
                             f"vocabulary {padded}")
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self.repartitioner = repartitioner
        self.keep_weights_buffer = keep_weights_buffer
        self.max_num_seqs = max_num_seqs
        self.gpu_memory_utilization = gpu_memory_utilization
        self.use_graphs = cuda_graphs and self.net.device.type == "cuda"
        self.max_prefill_tokens = max_prefill_tokens
        self.fused_decode_reason = (self.net.fused_decode_supported() if fused_decode
                                    else "fused_decode=False")
        self.fused = self.fused_decode_reason is None
        # [layers, 2, slots, len, groups, hd] when fused (token-major), else [.., groups, len, hd]
        self.cache: Optional[torch.Tensor] = None
        self._graphs: dict = {}
        self._graph_pool = None
        self.last_stats: dict[str, float] = {}

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
            return {}  # the model is the training model: its weights are current
        stats = self.repartitioner.run()
        return {"rollout/repartition_seconds": stats.seconds,
                "rollout/repartition_bytes_received": float(stats.bytes_received),
                "rollout/repartition_bytes_sent": float(stats.bytes_sent),
                "rollout/repartition_min_bytes_received": float(stats.min_bytes_received)}

    def sleep(self) -> None:
        self._graphs.clear()  # they hold addresses of the cache and the weights
        self._graph_pool = None
        self.cache = None
        if self.repartitioner is not None and not self.keep_weights_buffer:
            self.repartitioner.buffer.release()
        if self.net.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if self.repartitioner is not None:
            self.repartitioner.buffer.restore()

    def _ensure_cache(self, slots: int, length: int) -> int:
        """Allocate (or reuse) a cache for `slots` x `length`; returns the slots to use (fewer
        when the memory budget says so)."""
        length = self._bucket(length, 1 << 62)
        if self.cache is not None and self.cache.shape[2] >= slots and self._kv().shape[4] >= length:
            return slots
        self.cache, self._graphs, self._graph_pool = None, {}, None
        net = self.net
        if net.device.type == "cuda":
            torch.cuda.empty_cache()  # so the free-memory reading below includes the old cache
        per_slot = (len(net.layers) * 2 * net.groups * length * net.head_dim
                    * torch.empty((), dtype=net.dtype).element_size())
        fit = self._slots_that_fit(per_slot)
        if self.tp_group is not None:
            # Free memory differs between GPUs: the ranks of a group agree on the smallest fit, so
            # they run the same schedule (same collectives) and refuse together.
            unlimited = 1 << 62
            t = torch.tensor([unlimited if fit is None else fit], dtype=torch.long, device=net.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
            fit = None if int(t.item()) == unlimited else int(t.item())
        if fit is not None:
            if fit < 1:
                raise RuntimeError(
                    f"NativeEngine: one sequence of {length} tokens needs {per_slot / 2**20:.0f} MiB "
                    f"of KV cache, more than rollout.gpu_memory_utilization="
                    f"{self.gpu_memory_utilization} of the free GPU memory (on at least one rank "
                    "of the generation TP group)")
            slots = min(slots, fit)
        inner = (length, net.groups) if self.fused else (net.groups, length)
        self.cache = torch.zeros(len(net.layers), 2, slots, *inner, net.head_dim,
                                 dtype=net.dtype, device=net.device)
        # RoPE tables cover the cache; they only grow here, where the graphs (which hold their
        # addresses) were just dropped.
        net.rope_tables(length)
        return slots

    def _slots_that_fit(self, per_slot: int) -> Optional[int]:
        """KV-cache sequences within rollout.gpu_memory_utilization of this GPU's free memory;
        None (no limit) off the GPU."""
        if self.net.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(self.net.device)
        return int(free * self.gpu_memory_utilization) // per_slot

    def _kv(self) -> torch.Tensor:
        """The cache as [layers, 2, slots, groups, len, hd] whatever its memory layout (a
        transposed view of the fused path's token-major cache)."""
        return self.cache.transpose(3, 4) if self.fused else self.cache

    def _bucket(self, length: int, cap: int) -> int:
        """Attention length: rounded up for CUDA graphs (few shapes), exact otherwise."""
        if self.use_graphs:
            length = -(-length // _ATTN_BUCKET) * _ATTN_BUCKET
        return min(length, cap)

    # ---------------------------------------------------------------- forward passes

    def _prefill(self, prompts: list[list[int]], slots: torch.Tensor) -> torch.Tensor:
        """Run `prompts` (right-padded, causal) into cache `slots`; logits of each prompt's last
        token [n, V_local]."""
        lengths = [len(p) for p in prompts]
        s = max(lengths)
        tokens = torch.zeros(len(prompts), s, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        tokens = tokens.to(self.net.device)
        positions = torch.arange(s, device=self.net.device).expand(len(prompts), s)
        kv = self._kv()

        def attend(i, q, k, v):
            # [s, n, heads, hd] -> [n, heads, s, hd]; right padding never reaches a real token
            # under the causal mask, and the padded cache rows are masked until overwritten.
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            kv[i, 0, slots, :, :s] = k
            kv[i, 1, slots, :, :s] = v
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.net.scale,
                                                 enable_gqa=self.net.heads != self.net.groups)
            return out.permute(2, 0, 1, 3).reshape(s, len(prompts), -1)

        h = self.net.forward(tokens, positions, attend)  # [s, n, H]
        last = torch.as_tensor(lengths, device=h.device) - 1
        h = h[last, torch.arange(len(prompts), device=h.device)].unsqueeze(0)  # [1, n, H]
        return self.net.logits(h)[0]

    def _decode_forward(self, tokens: torch.Tensor, positions: torch.Tensor, length: int
                        ) -> torch.Tensor:
        """One token per slot: tokens/positions [slots] -> logits [slots, V_local]. Keys at
        cache positions > a slot's position are masked; attention reads `length` positions."""
        if self.fused:
            return self.net.logits(self.net.fused_decode(tokens, positions, self.cache))[0]
        cache = self.cache
        b = tokens.shape[0]
        r = self.net.heads // self.net.groups
        rows = torch.arange(b, device=tokens.device)
        keep = torch.arange(length, device=tokens.device).unsqueeze(0) <= positions.unsqueeze(1)
        bias = torch.zeros(b, 1, 1, length, dtype=torch.float32, device=tokens.device)
        bias = bias.masked_fill(~keep.view(b, 1, 1, length), float("-inf"))

        def attend(i, q, k, v):
            # q [1, b, nh, hd], k/v [1, b, ng, hd]; grouped-query attention without repeating K/V.
            cache[i, 0, rows, :, positions] = k[0]
            cache[i, 1, rows, :, positions] = v[0]
            keys, values = cache[i, 0, :b, :, :length], cache[i, 1, :b, :, :length]
            qg = q[0].view(b, self.net.groups, r, self.net.head_dim)
            scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.net.scale + bias
            probs = torch.softmax(scores, dim=-1).to(values.dtype)
            return torch.matmul(probs, values).reshape(1, b, -1)

        h = self.net.forward(tokens.unsqueeze(1), positions.unsqueeze(1), attend)
        return self.net.logits(h)[0]

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        if not self.use_graphs:
            return self._decode_forward(tokens, positions, length)
        entry = self._graphs.get((tokens.shape[0], length))
        if entry is None:
            try:
                entry = self._capture(tokens, positions, length)
            except RuntimeError as e:  # e.g. an op that syncs with the host inside megatron
                warnings.warn(f"NativeEngine: CUDA graph capture failed ({e}); decoding eagerly")
                torch.cuda.synchronize()
                self.use_graphs, self._graphs, self._graph_pool = False, {}, None
                return self._decode_forward(tokens, positions, length)
        graph, static_tokens, static_pos, out = entry
        static_tokens.copy_(tokens)
        static_pos.copy_(positions)
        graph.replay()
        return out

    def _capture(self, tokens: torch.Tensor, positions: torch.Tensor, length: int):
        """Capture the decode step for this batch and attention length. Warm-up and capture run
        on this step's real inputs: they write the same K/V the replay then writes again."""
        static_tokens, static_pos = tokens.clone(), positions.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # lazy initialisations and allocator warm-up outside the capture
                self._decode_forward(static_tokens, static_pos, length)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._decode_forward(static_tokens, static_pos, length)
        entry = (graph, static_tokens, static_pos, out)
        self._graphs[(tokens.shape[0], length)] = entry
        return entry

    def _pick(self, logits_local: torch.Tensor, sp: SamplingParams, u: Optional[np.ndarray]
              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Tokens [b] (and their log-probs) from vocab-parallel logits [b, V_local], the same on
        every rank of the TP group."""
        u_t = None if u is None else torch.from_numpy(u).to(logits_local.device)
        if self.tp_group is not None:
            return tp_sampling.sample_vocab_parallel(
                logits_local, sp.temperature, sp.top_p, sp.top_k, u_t, vocab_size=self.vocab_size,
                group=self.tp_group, logprobs=sp.logprobs)
        full = logits_local[:, : self.vocab_size]
        tokens = sampling_mod.sample(full, sp.temperature, sp.top_p, sp.top_k, u_t)
        logp = sampling_mod.token_logprobs(full, tokens, sp.temperature) if sp.logprobs else None
        return tokens, logp

    # ---------------------------------------------------------------- generation loop

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams
                 ) -> list[SampleOutput]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), _sequence_parallel_off(self.model):
                return self._generate(prompt_token_ids, sampling)
        finally:
            self.model.train(was_training)

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
        max_pos = getattr(self.model, "max_sequence_length", None)
        if max_pos is not None and max_len > max_pos:
            raise ValueError(f"NativeEngine.generate: prompt + max_new_tokens = {max_len} exceeds "
                             f"the model's max_position_embeddings {max_pos}")
        slots = self._ensure_cache(min(self.max_num_seqs, len(prompts) * sp.n), max_len)
        seed = sp.seed
        if seed is None and not sp.greedy:
            seed = int(torch.randint(0, 2**62, ()).item())
        st = _Schedule(prompts, sp, slots, seed or 0)
        while st.waiting or st.any_active():
            if st.waiting and st.free_slots():
                self._admit(st)  # then admit again if slots freed up (e.g. max_new_tokens = 1)
            else:
                self._step(st)
        # Occupancy: the share of slot-steps that decoded a live sequence (continuous batching
        # refills a finished sequence's slot at the next admission).
        occupancy = st.live_slot_steps / max(1, st.decode_steps * slots)
        self.last_stats = {"rollout/seconds": time.perf_counter() - start,
                           "rollout/response_tokens": float(sum(map(len, st.tokens))),
                           "rollout/prefill_tokens": float(st.prefill_tokens),
                           "rollout/decode_steps": float(st.decode_steps),
                           "rollout/slots": float(slots),
                           "rollout/slot_occupancy": occupancy}
        return [SampleOutput(prompt_index=s // sp.n, sample_index=s % sp.n,
                             token_ids=st.tokens[s], logprobs=st.logprobs[s] if sp.logprobs else None,
                             finish_reason=st.finish[s])
                for s in range(st.n_seq)]

    def _admit(self, st: "_Schedule") -> None:
        """Prefill waiting sequences into free slots and sample their first tokens."""
        sp, n, device = st.sp, st.sp.n, self.net.device
        free = st.free_slots()
        # Whole prompts' worth of sequences, up to the free slots and the prefill budget. The
        # prefill pads every prompt to the longest: the budget is charged prompts x longest.
        admitted, prompts_in, longest = [], 0, 0
        while st.waiting and len(admitted) < len(free):
            s = st.waiting[0]
            if not admitted or s // n != admitted[-1] // n:  # the first sample of a prompt
                wider = max(longest, len(st.prompts[s // n]))
                if admitted and (prompts_in + 1) * wider > self.max_prefill_tokens:
                    break
                prompts_in, longest = prompts_in + 1, wider
            admitted.append(st.waiting.popleft())
        seq_slots = free[: len(admitted)]
        firsts: dict[int, int] = {}  # prompt -> slot of its first admitted sample
        for s, slot in zip(admitted, seq_slots):
            firsts.setdefault(s // n, slot)
        uniq = list(firsts)
        logits = self._prefill([st.prompts[p] for p in uniq],
                               torch.as_tensor([firsts[p] for p in uniq], device=device))
        st.prefill_tokens += sum(len(st.prompts[p]) for p in uniq)
        # The other samples of a prompt share its prompt cache: copy the rows.
        dup = [(firsts[s // n], slot) for s, slot in zip(admitted, seq_slots)
               if slot != firsts[s // n]]
        if dup:
            src = torch.as_tensor([a for a, _ in dup], device=device)
            dst = torch.as_tensor([b for _, b in dup], device=device)
            plen = max(len(st.prompts[p]) for p in uniq)
            kv = self._kv()
            kv[:, :, dst, :, :plen] = kv[:, :, src, :, :plen]
        row = {p: i for i, p in enumerate(uniq)}
        rows = torch.as_tensor([row[s // n] for s in admitted], device=device)
        for s, slot in zip(admitted, seq_slots):
            st.slot_seq[slot] = s
            st.pos[slot] = len(st.prompts[s // n])
        toks, lps = self._pick(logits[rows], sp, st.uniforms(admitted))
        st.record(admitted, seq_slots, toks.tolist(), None if lps is None else lps.tolist())

    def _step(self, st: "_Schedule") -> None:
        """One decoding step of every slot; sample for the active ones."""
        device = self.net.device
        active = st.active_slots()
        cap = self._kv().shape[4]
        # The fused path reads each sequence's own keys: it always takes the whole cache (one
        # CUDA graph); the masked attention reads a bucket of it.
        length = cap if self.fused else self._bucket(int(st.pos[active].max()) + 1, cap)
        logits = self._decode(torch.from_numpy(st.last).to(device),
                              torch.from_numpy(st.pos).to(device), length)
        seq_ids = [st.slot_seq[i] for i in active]
        toks, lps = self._pick(logits[torch.as_tensor(active, device=device)], st.sp,
                               st.uniforms(seq_ids))
        st.pos[active] += 1
        st.record(seq_ids, active, toks.tolist(), None if lps is None else lps.tolist())
        st.decode_steps += 1
        st.live_slot_steps += len(active)


class _Schedule:
    """Host-side state of one generate call: which sequence sits in which slot, its next input
    token and position, and what each sequence has produced. Sequence s is sample s % n of
    prompt s // n."""

    def __init__(self, prompts: list[list[int]], sp: SamplingParams, slots: int, seed: int):
        self.prompts, self.sp = prompts, sp
        self.n_seq = len(prompts) * sp.n
        self.keys = sampling_mod.sequence_keys(seed, np.repeat(np.arange(len(prompts)), sp.n),
                                               np.tile(np.arange(sp.n), len(prompts)))
        self.stop = set(sp.stop_token_ids)
        self.waiting = deque(range(self.n_seq))
        self.tokens: list[list[int]] = [[] for _ in range(self.n_seq)]
        self.logprobs: list[list[float]] = [[] for _ in range(self.n_seq)]
        self.finish: list[Optional[str]] = [None] * self.n_seq
        self.slot_seq = [-1] * slots  # sequence held by each slot (-1: free)
        self.pos = np.zeros(slots, dtype=np.int64)  # position of the token fed at the next step
        self.last = np.zeros(slots, dtype=np.int64)  # that token
        self.prefill_tokens = self.decode_steps = self.live_slot_steps = 0

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slot_seq) if s < 0]

    def active_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slot_seq) if s >= 0]

    def any_active(self) -> bool:
        return any(s >= 0 for s in self.slot_seq)

    def uniforms(self, seq_ids: list[int]) -> Optional[np.ndarray]:
        """Each sequence's random number for its next token (None for greedy)."""
        if self.sp.greedy:
            return None
        steps = np.array([len(self.tokens[s]) for s in seq_ids], dtype=np.int64)
        return sampling_mod.uniforms(self.keys[seq_ids], steps)

    def record(self, seq_ids, slot_ids, toks, lps) -> None:
        """Append one sampled token per sequence; free the slots of finished ones."""
        for j, (s, slot) in enumerate(zip(seq_ids, slot_ids)):
            t = int(toks[j])
            self.tokens[s].append(t)
            if lps is not None:
                self.logprobs[s].append(float(lps[j]))
            if t in self.stop:
                self.finish[s] = "stop"
            elif len(self.tokens[s]) >= self.sp.max_new_tokens:
                self.finish[s] = "length"
            if self.finish[s] is not None:
                self.slot_seq[slot] = -1
            else:
                self.last[slot] = t
