"""The memory model of a run: per-GPU bytes of every phase of a step, from the config and the
model's shape, no GPU needed; the choices the trainer makes from it (offload between phases,
micro-batch token budgets) and the single-knob changes that make a config fit. The
`verl-mcore-plan` CLI (verl_mcore/plan.py) prints it; the trainer (build.py) runs the same
functions with the GPU it has.

Memory model (bytes per GPU; P = parameters held by this rank; T = tokens of one micro-batch on
this rank; t = TP, p = PP, d = DP, c = CP; b = bytes of the model dtype: 2 for bf16/fp16, 4 fp32).
The estimate is for the pipeline stage with the highest total (usually the first).

  parameters          b·P.  P per rank: every decoder layer of the stage (matrices / t, norms whole)
                      plus the vocab-parallel embedding (first stage) and output layer (last
                      stage; with tied embeddings and p = 1 they are one tensor). A MoE layer
                      holds its router, E / EP routed experts (each / t) and a shared expert. Vocabulary
                      padded as our builder does (a multiple of lcm(make_vocab_size_divisible_by,
                      t)). The critic has a [h, 1] value head instead of the output layer.
  gradients           4·P: megatron's DDP accumulates and reduces gradients in an fp32 buffer
                      for bf16 models (the buffer is whole on every DP rank, also with the
                      distributed optimizer).
  optimizer           Adam m and v in fp32 (8·P) plus an fp32 master copy for 16-bit models
                      (4·P): 12·P for bf16, 8·P for fp32; divided by d with
                      parallel.use_distributed_optimizer (ZeRO-1), the routed experts' part by
                      d / EP (their expert data-parallel group).
  activations         per layer and token, the tensors autograd keeps for backward (bf16):
                        attention: 2·h/s (norm input, QKV input) + (a_l + 2·kv_l)·hd (the QKV
                                   output, kept whole by the v view into it) + (a_l + kv_l)·hd
                                   (q and k after RoPE) + a_l·hd (core-attention output)
                                   + 4·a_l (fp32 log-sum-exp)
                        MLP (SwiGLU): 2·h/s (norm input, fc1 input) + 2·f/t (fc1 output)
                                   + 3·f/t (megatron's unfused glu: silu output, a copy of the
                                   gate, the product that is fc2's input)
                      with s = t under sequence parallelism (else 1), a_l = a/t, kv_l =
                      max(kv/t, 1), f the FFN size. This is Korthikanti et al. 2022 (arXiv
                      2205.05198) redone for SwiGLU, GQA, RMSNorm, no dropout and a flash /
                      varlen core attention that keeps no [s, s] scores; `--attention
                      materialized` adds 6·a_l·S bytes per token for sequences of length S
                      (megatron's local attention: fp32 softmax output + bf16 probabilities).
                      × layers of the stage × micro-batches in flight under 1F1B (p − stage,
                      at most the number of micro-batches; × (1 + (p−1)/(p·vpp)) interleaved),
                      divided by c. With *.recompute_activations (full recompute, one layer per
                      checkpoint) only the layer inputs h/s per layer and token are kept, plus one
                      layer's full activations while it is recomputed.
                      T = max_tokens_per_microbatch (packed) or micro_batch_size_per_gpu ×
                      (max_prompt_length + max_response_length) (padded).
                      The saved tensors were listed with autograd's saved-tensor hooks on one
                      layer of the Qwen2.5-1.5B shape (2026-12-03; the CPU's unfused RMSNorm
                      aside, whose fp32 copies the GPU's fused norm does not keep).
  logits              last stage, actor only: T·V/t bf16 logits kept for the fused log-prob /
                      entropy op, plus their gradient of the same size in backward.
  generation weights  the TP_g-only copy of the actor that the engine reads: 2·P_full/TP_g, the
                      vocabulary padded as in training, for t (none when TP_g = t and p = 1: the
                      training parameters are used in place).
  KV cache            2 (K, V) · layers · kv_g · hd · 2 bytes per token, kv_g = max(kv/TP_g, 1),
                      for min(rollout.max_num_seqs, sequences per generation group) sequences of
                      max_prompt_length + max_response_length tokens.
  engine overhead     fp32 sampling logits of the decoding batch over the whole (gathered)
                      vocabulary (×3: logits, probabilities, sorted copy for top-p) + one layer's
                      activations for a prefill chunk of PREFILL_CHUNK_TOKENS tokens (logits only
                      for each prompt's last token).
  runtime             RUNTIME_OVERHEAD_GIB: CUDA context, NCCL buffers of all groups, cuBLAS
                      workspaces. A guess to calibrate against measured peaks.
  rollout batch       the step's global batch on every rank after generation: input_ids (int64,
                      samples × (prompt + response)) and the response-aligned float32 fields
                      (mask, old / ref log-probs, values, rewards, advantages, returns).
  LoRA                (actor.lora / critic.lora, models/lora.py) the base is frozen at the
                      compute dtype: parameters b·(P + P_a), gradients and optimizer only for
                      P_a, the adapters of the stage's layers (A [r, in] and B [out, r] per
                      targeted module, B split over t on a column-parallel module, A on a
                      row-parallel one; lm_head's on the last stage, B over the padded
                      vocabulary), plus a critic's value head h. Activations add each
                      adapted linear's x·Aᵀ (r per targeted part), and with lora.dropout the
                      dropped input and its mask. The reference is the actor's model with its
                      adapters off (no weights of its own), and the generation weights are a
                      copy of their own also when TP_g = t and p = 1 (W + (alpha/r)·B·A).
                      Not yet checked against a measured LoRA run.
Checked against H200 runs (bench/RESULTS.md 2026-12-03, the 1.5B GRPO and PPO steps, offload
off; tests/hpc/test_plan.py), the estimate without `runtime` (which lies outside torch's
allocator) against max_memory_allocated: within 10% in every phase (RESULTS.md has the table).
A phase fits when its total is at most USABLE_FRACTION of the GPU (allocator fragmentation and
temporaries not modelled above).

Colocation policy (DESIGN.md): with trainer.offload_between_phases=true the optimizer states and
gradient buffers of the actor and critic live in pinned host memory between phases; with false
they stay on the GPU; "auto" (the default) keeps them on the GPU when every phase fits that way
and offloads otherwise (`choose_offload`, which the trainer runs too). Parameters of the actor,
critic and reference stay on the GPU unless reference.offload_params. `--no-offload` is
trainer.offload_between_phases=false. Phases: generate; score (the forward-only log-prob
passes: old and reference log-probs); values (the critic's forward pass, GAE only: no logits);
actor_update; critic_update (GAE only). The reference's weights are on the GPU in every phase
unless reference.offload_params, and then only in score (the reference pass). Host memory per
node = GPUs per node × what a GPU offloads. Reward models are not modelled yet. The activation
terms are megatron's local layer spec (no TransformerEngine), as measured; TE's fused layers
keep fewer tensors, so with TE the estimate errs high.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Optional

from verl_mcore.config import Config, ConfigError, ModelShape, data_parallel_size, validate
from verl_mcore.config.placement import Placement
from verl_mcore.config.schema import padded_micro_batches, planner_micro_batches
from verl_mcore.config.validate import rollout_batch_bytes
from verl_mcore.models.hub import load_config_json, local_dir
from verl_mcore.models.lora_targets import (HF_TARGETS, adapts_head, layer_targets, part_shapes,
                                            resolve_targets, tp_shard_dim)

GiB = 1024 ** 3
RUNTIME_OVERHEAD_GIB = 2.0
USABLE_FRACTION = 0.92
PREFILL_CHUNK_TOKENS = 8192


# ---------------------------------------------------------------------------------------------
# Model shapes
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelDims:
    """What the memory model needs from an HF config (a superset of config.ModelShape)."""

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3's per-head q / k RMSNorm weights
    # Mixture of experts (models/hf_config.MoESpec): routed experts per MoE layer (0: dense),
    # their FFN size, top-k, the shared expert's FFN size (0: none), the MoE layers' indices.
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    shared_expert_ffn_hidden_size: int = 0
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, hf: dict, where: str = "config.json") -> "ModelDims":
        try:
            moe = _moe_dims(hf)
            heads = hf["num_attention_heads"]
            return cls(**moe,
                hidden_size=hf["hidden_size"],
                ffn_hidden_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads") or heads,
                vocab_size=hf["vocab_size"],
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                # Qwen2 always, Qwen2-MoE as its qkv_bias says (models/hf_config.read_hf_arch)
                qkv_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")) or (
                    hf.get("model_type") == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
                qk_norm=hf.get("model_type") in ("qwen3", "qwen3_moe"),
            )
        except KeyError as e:
            raise ConfigError(f"{where}: missing field {e.args[0]} (model.path)") from None

    def shape(self) -> ModelShape:
        return ModelShape(self.num_attention_heads, self.num_key_value_heads, self.num_layers,
                          self.vocab_size, self.hidden_size,
                          num_experts=self.num_experts or None)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer in self.moe_layers

    # models/hf_config.HFArch's spellings, so that models/lora.part_shapes reads a ModelDims too.
    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads


def _moe_dims(hf: dict) -> dict:
    """The MoE fields of a qwen2_moe / qwen3_moe / mixtral config.json, read as
    models/hf_config._read_moe reads them (that module imports torch, which the planner, run on
    login nodes, does not; tests/hpc/test_plan_moe.py holds the two readers together)."""
    model_type = hf.get("model_type")
    if model_type not in ("qwen2_moe", "qwen3_moe", "mixtral"):
        return {}
    layers = hf["num_hidden_layers"]
    if model_type == "mixtral":
        ffn, moe_layers, shared = hf["intermediate_size"], tuple(range(layers)), 0
    else:
        step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or [])
        ffn = hf["moe_intermediate_size"]
        moe_layers = tuple(i for i in range(layers)
                           if i not in dense and step > 0 and (i + 1) % step == 0)
        shared = (hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    return dict(num_experts=hf.get("num_experts") or hf["num_local_experts"],
                moe_ffn_hidden_size=ffn, moe_topk=hf["num_experts_per_tok"],
                shared_expert_ffn_hidden_size=shared, moe_layers=moe_layers)


# Published shapes (the models' config.json on the Hugging Face hub), for planning offline with
# `model.path=<hub id>`. Keys are the lower-cased last path component without "-instruct".
KNOWN_SHAPES: dict[str, ModelDims] = {
    "meta-llama-3-8b": ModelDims(4096, 14336, 32, 32, 8, 128256, 128),
    "meta-llama-3-70b": ModelDims(8192, 28672, 80, 64, 8, 128256, 128),
    "qwen2.5-1.5b": ModelDims(1536, 8960, 28, 12, 2, 151936, 128, tie_word_embeddings=True,
                              qkv_bias=True),
    "qwen2.5-3b": ModelDims(2048, 11008, 36, 16, 2, 151936, 128, tie_word_embeddings=True,
                            qkv_bias=True),
    "qwen2.5-7b": ModelDims(3584, 18944, 28, 28, 4, 152064, 128, qkv_bias=True),
    "qwen2.5-32b": ModelDims(5120, 27648, 64, 40, 8, 152064, 128, qkv_bias=True),
}
# Llama 3.1 has the Llama 3 shapes.
KNOWN_SHAPES["llama-3.1-8b"] = KNOWN_SHAPES["meta-llama-3.1-8b"] = KNOWN_SHAPES["meta-llama-3-8b"]
KNOWN_SHAPES["llama-3.1-70b"] = KNOWN_SHAPES["meta-llama-3.1-70b"] = KNOWN_SHAPES["meta-llama-3-70b"]


def resolve_dims(model_path: Optional[str], revision: Optional[str] = None) -> ModelDims:
    """config.json of a local HF directory or of a Hub id's snapshot in the Hugging Face cache,
    else the KNOWN_SHAPES entry for a hub id. The planner never downloads: it runs in seconds
    on a login node, and a model's weights are the trainer's to fetch."""
    if not model_path:
        raise ConfigError("the planner needs model.path (an HF directory or a known hub id)")
    key = os.path.basename(model_path.rstrip("/")).lower().removesuffix("-instruct")
    try:
        model_path = local_dir(model_path, revision, "model.path", download=False)
    except ConfigError:
        if key not in KNOWN_SHAPES:
            raise
    cfg_file = os.path.join(model_path, "config.json")
    if os.path.isfile(cfg_file):
        return ModelDims.from_hf_config(load_config_json(cfg_file), cfg_file)
    if key in KNOWN_SHAPES:
        return KNOWN_SHAPES[key]
    raise ConfigError(f"model.path={model_path!r}: no config.json there and not a known shape "
                      f"({', '.join(sorted(KNOWN_SHAPES))}); point model.path at a local HF "
                      "directory (only its config.json is read)")


# ---------------------------------------------------------------------------------------------
# Memory model (formulas in the module docstring)
# ---------------------------------------------------------------------------------------------

def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def padded_vocab(dims: ModelDims, tp: int, divisible_by: int) -> int:
    """As verl_mcore.models.hf_config.padded_vocab_size: a multiple of lcm(divisible_by, tp)."""
    multiple = math.lcm(divisible_by, tp)
    return math.ceil(dims.vocab_size / multiple) * multiple


def layer_params(dims: ModelDims, tp: int, layer: int = 0, ep: int = 1) -> int:
    """Parameters of decoder layer `layer` (global index) on one TP (and EP) rank. A MoE
    layer's MLP: the router [E, h] (replicated), E / ep routed SwiGLU experts sliced over TP
    (expert TP = TP), the shared expert over TP and its [1, h] gate."""
    h, hd = dims.hidden_size, dims.head_dim
    q = dims.num_attention_heads * hd // tp
    kv = max(dims.num_key_value_heads // tp, 1) * hd
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if dims.qkv_bias else 0)
    attn += 2 * hd if dims.qk_norm else 0
    if dims.is_moe_layer(layer):
        shared = dims.shared_expert_ffn_hidden_size
        mlp = (dims.num_experts * h + expert_params(dims, tp, layer, ep)
               + (3 * h * shared // tp + h if shared else 0))
    else:
        mlp = 3 * h * dims.ffn_hidden_size // tp
    return attn + mlp + 2 * h  # two RMSNorm weights, replicated over TP


def expert_params(dims: ModelDims, tp: int, layer: int, ep: int = 1) -> int:
    """The routed experts' parameters of layer `layer` on one TP x EP rank (0 for a dense
    layer): the optimizer shards them over the expert data-parallel group (DP / EP), not DP."""
    if not dims.is_moe_layer(layer):
        return 0
    return dims.num_experts // ep * 3 * dims.hidden_size * dims.moe_ffn_hidden_size // tp


def stage_layers(dims: ModelDims, pp: int, stage: int) -> range:
    per = dims.num_layers // pp
    return range(stage * per, (stage + 1) * per)


def stage_params(dims: ModelDims, tp: int, pp: int, stage: int, divisible_by: int,
                 vocab_tp: Optional[int] = None, ep: int = 1) -> int:
    """Parameters held by one rank of pipeline stage `stage` (of a MoE model, its EP block of
    the routed experts: all of them at ep = 1, as the generation copy holds). The vocabulary is
    padded for TP `vocab_tp` (default `tp`): the generation copy keeps the training TP's
    padding."""
    vocab_shard = padded_vocab(dims, vocab_tp or tp, divisible_by) // tp * dims.hidden_size
    n = sum(layer_params(dims, tp, layer, ep) for layer in stage_layers(dims, pp, stage))
    if stage == 0:
        n += vocab_shard
    if stage == pp - 1:
        n += dims.hidden_size  # final norm
        if not (dims.tie_word_embeddings and pp == 1):
            n += vocab_shard
    return n


def total_params(dims: ModelDims) -> int:
    """Unsharded, unpadded parameter count."""
    return stage_params(dims, 1, 1, 0, 1)


def role_params(cfg: Config, dims: ModelDims, role: str, stage: int) -> int:
    """Parameters of `role` on one rank of `stage` in the training layout.

    The critic has a [h, 1] value head instead of the output layer (whose size we drop; a tied
    one at p = 1 is the embedding, which stays, and the head is a tensor of its own).
    """
    p, div = cfg.parallel, cfg.model.make_vocab_size_divisible_by
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    n = stage_params(dims, tp, pp, stage, div, ep=p.expert_model_parallel_size)
    if role == "critic" and stage == pp - 1:
        if dims.tie_word_embeddings and pp == 1:
            n += dims.hidden_size
        else:
            n -= padded_vocab(dims, tp, div) // tp * dims.hidden_size - dims.hidden_size
    return n


def lora_roles(cfg: Config) -> list[str]:
    """The trained roles whose base is frozen and whose LoRA adapters train (actor.lora,
    critic.lora; the critic only where it runs)."""
    roles = ["actor"] + (["critic"] if cfg.uses_critic else [])
    return [role for role in roles if getattr(cfg, role).lora.enable]


def lora_layer_params(dims: ModelDims, lora, tp: int) -> int:
    """LoRA adapter parameters of one decoder layer on one TP rank: A [r, in] and B [out, r] of
    each targeted HF module, the one models/lora.tp_shard_dim names split over TP (B of a
    column-parallel module, A of a row-parallel one), the other whole on every rank."""
    n = 0
    for target in layer_targets(lora.target_modules):  # lm_head's: lora_head_params
        out, inp = part_shapes(dims, target)
        n += lora.r * inp // (1 if tp_shard_dim(target, "A") is None else tp)
        n += out // (1 if tp_shard_dim(target, "B") is None else tp) * lora.r
    return n


def lora_head_params(dims: ModelDims, lora, tp: int, divisible_by: Optional[int] = None) -> int:
    """The output layer's adapter (lora.target_modules lm_head) on one TP rank of the last
    stage: A [r, h] whole, B [V/t, r] split, V padded as the model's (`divisible_by`; None:
    the HF vocabulary, as peft's)."""
    if not adapts_head(lora.target_modules):
        return 0
    vocab = padded_vocab(dims, tp, divisible_by) if divisible_by else dims.vocab_size
    return lora.r * (dims.hidden_size + vocab // tp)


def lora_trainable_params(dims: ModelDims, lora, role: str) -> int:
    """Parameters that train on `role` with `lora`, whole (each tensor once, unsharded):
    r·(in + out) per targeted module per layer and for lm_head, plus a critic's [1, h] value
    head."""
    head = dims.hidden_size if role == "critic" else 0
    return dims.num_layers * lora_layer_params(dims, lora, 1) + lora_head_params(dims, lora, 1) + head


def model_params(dims: ModelDims, role: str) -> int:
    """Unsharded, unpadded parameters of the role's model: the critic's [1, h] value head takes
    the output layer's place (a tied output layer is the embedding, which stays)."""
    if role != "critic":
        return total_params(dims)
    output = 0 if dims.tie_word_embeddings else dims.vocab_size * dims.hidden_size
    return total_params(dims) - output + dims.hidden_size


def adapter_params(cfg: Config, dims: ModelDims, role: str, stage: int) -> int:
    """LoRA adapter parameters of `role` on one rank of `stage` (0 without LoRA)."""
    if role not in lora_roles(cfg):
        return 0
    p = cfg.parallel
    lora, tp = getattr(cfg, role).lora, p.tensor_model_parallel_size
    head = (lora_head_params(dims, lora, tp, cfg.model.make_vocab_size_divisible_by)
            if stage == p.pipeline_model_parallel_size - 1 else 0)
    return dims.num_layers // p.pipeline_model_parallel_size * lora_layer_params(dims, lora, tp) + head


def trainable_params(cfg: Config, dims: ModelDims, role: str, stage: int) -> int:
    """Parameters of `role` that train on one rank of `stage` (those with gradients, an fp32
    master copy and Adam moments): every one, or with LoRA the adapters of the stage's layers
    and, on the last stage, a critic's value head (replicated over TP)."""
    if role not in lora_roles(cfg):
        return role_params(cfg, dims, role, stage)
    head = role == "critic" and stage == cfg.parallel.pipeline_model_parallel_size - 1
    return adapter_params(cfg, dims, role, stage) + (dims.hidden_size if head else 0)


def lora_summary(cfg: Config, dims: ModelDims, role: str) -> str:
    """One line on the role's LoRA: what trains, of how much, and its settings."""
    lora = getattr(cfg, role).lora
    n, of = lora_trainable_params(dims, lora, role), model_params(dims, role)
    head = " (with the value head)" if role == "critic" else ""
    return (f"{role} LoRA: {n:,} trainable parameters{head}, {100 * n / of:.3f}% of the "
            f"model's {of:,}; r={lora.r}, alpha={lora.alpha:g}, targets "
            + ",".join(resolve_targets(lora.target_modules)))


def checkpoint_bytes(cfg: Config, dims: ModelDims) -> dict[str, int]:
    """Expected size on disk of one checkpoint of each trained role ("actor", and "critic" with
    GAE), all ranks together: the model in its dtype, plus with checkpoint.save_optimizer the
    optimizer state megatron writes in parameter space (fp32 master copy and Adam's two moments,
    12 bytes a parameter, also for fp32 models). A role with LoRA saves only what trains (the
    adapters, a critic's value head) and their optimizer state. RNG, trainer state and metadata
    add a few percent (the tiny test model: 1.45 MB estimated, 1.66 MB written)."""
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    roles = ["actor"] + (["critic"] if cfg.uses_critic else [])
    out = {}
    for role in roles:
        if role in lora_roles(cfg):
            params = lora_trainable_params(dims, getattr(cfg, role).lora, role)
        else:
            params = tp * sum(role_params(cfg, dims, role, stage) for stage in range(pp))
        per_param = _dtype_bytes(getattr(cfg, role).dtype) + (12 if cfg.checkpoint.save_optimizer else 0)
        out[role] = params * per_param
    return out


def activation_bytes_per_token_layer(dims: ModelDims, tp: int, sequence_parallel: bool,
                                     dtype_bytes: int = 2) -> int:
    h, hd, f = dims.hidden_size, dims.head_dim, dims.ffn_hidden_size
    s = tp if sequence_parallel else 1
    a_l = dims.num_attention_heads // tp
    kv_l = max(dims.num_key_value_heads // tp, 1)
    attn = (2 * h // s + (a_l + 2 * kv_l) * hd + (a_l + kv_l) * hd + a_l * hd) * dtype_bytes + 4 * a_l
    mlp = (2 * h // s + 5 * f // tp) * dtype_bytes
    if dims.num_experts:
        mlp = max(mlp, moe_activation_bytes_per_token(dims, tp, sequence_parallel, dtype_bytes))
    return attn + mlp


def moe_activation_bytes_per_token(dims: ModelDims, tp: int, sequence_parallel: bool,
                                   dtype_bytes: int = 2) -> int:
    """A MoE layer's MLP activations per token (estimated, not yet checked against a measured
    run): the norm and router inputs (2·h/s), the router's fp32 logits and probabilities
    (8·E), and for each of its k experts the permuted input and the all-to-all's received copy
    (2·h) and a SwiGLU expert's fc1 output and glu tensors (5·f_e/t), the unpermuted output
    (h), plus a shared expert as a dense MLP (5·f_s/t) with its gate. Every layer of a MoE
    model is counted as its larger kind (a few dense layers among MoE ones are overestimated)."""
    h, s, k = dims.hidden_size, tp if sequence_parallel else 1, dims.moe_topk
    routed = k * (2 * h + 5 * dims.moe_ffn_hidden_size // tp + h)
    shared = 5 * dims.shared_expert_ffn_hidden_size // tp + 1
    return (2 * h // s + routed + shared) * dtype_bytes + 8 * dims.num_experts


def lora_activation_bytes_per_token_layer(dims: ModelDims, lora, tp: int, sequence_parallel: bool,
                                          dtype_bytes: int = 2) -> int:
    """What one layer's adapters (models/lora.LoRAAdapter.forward) add to the tensors kept for
    backward, per token: each adapted linear's x·Aᵀ, r wide per targeted part (along this
    rank's sequence shard for a row-parallel one under sequence parallelism); with lora.dropout
    the dropped input and its 1-byte mask; under sequence parallelism a column-parallel
    adapter's gathered input, which megatron's own linear does not keep."""
    b, s = dtype_bytes, tp if sequence_parallel else 1
    linears: dict[str, list[str]] = {}
    # lm_head's x·Aᵀ is not a layer's: training_bytes adds it to the last stage's logits
    for target in layer_targets(lora.target_modules):
        linears.setdefault(HF_TARGETS[target][0], []).append(target)
    n = 0
    for parts in linears.values():
        row = tp_shard_dim(parts[0], "A") is not None
        inp = part_shapes(dims, parts[0])[1] // (tp if row else 1)
        n += len(parts) * lora.r * b // (s if row else 1)
        if lora.dropout:
            n += inp * (b + 1)
        elif sequence_parallel and not row:
            n += inp * b
    return n


@dataclass(frozen=True)
class Knobs:
    """Planner options that are not config fields."""

    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    host_memory_gib: Optional[float] = None  # per node; None: not checked
    attention: str = "flash"  # "flash" (varlen / TE) or "materialized" (megatron local spec)
    offload: bool = True  # grads + optimizer states in host memory outside their update phase
    # (the CLI and the trainer set it from trainer.offload_between_phases: choose_offload)


def _micro_tokens(cfg: Config, role: str) -> tuple[int, int]:
    """(tokens per micro-batch on one rank, samples per micro-batch or 0 when packed)."""
    r = getattr(cfg, role)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    if r.max_tokens_per_microbatch:
        return r.max_tokens_per_microbatch, 0
    if r.micro_batch_size_per_gpu is None:
        raise ValueError(f"{role}: plan a config after choose_token_budgets, which sets the "
                         "token budget of a role with no micro-batch setting")
    return r.micro_batch_size_per_gpu * seq, r.micro_batch_size_per_gpu


def _num_microbatches(cfg: Config, role: str, dp: int) -> int:
    r = getattr(cfg, role)
    mini = (getattr(r, "ppo_mini_batch_size", None) or cfg.actor.ppo_mini_batch_size) * cfg.rollout.n
    per_rank = max(mini // dp, 1)
    tokens, samples = _micro_tokens(cfg, role)
    if samples:
        return max(per_rank // samples, 1)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    return max(math.ceil(per_rank * seq / tokens), 1)


def training_bytes(cfg: Config, dims: ModelDims, world: int, role: str, stage: int,
                   knobs: Knobs) -> dict[str, int]:
    """Per-GPU bytes of the model `role` ("actor" or "critic") while it trains, on `stage`."""
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    dp = data_parallel_size(cfg, world)
    dtype = getattr(cfg, role).dtype
    b = _dtype_bytes(dtype)
    # With LoRA the frozen base is held at the compute dtype only; the adapters are model
    # parameters too, and they alone (with a critic's value head) train.
    n = role_params(cfg, dims, role, stage) + adapter_params(cfg, dims, role, stage)
    trained = trainable_params(cfg, dims, role, stage)
    opt_per_param = 8 + (4 if b < 4 else 0)
    optimizer = opt_per_param * trained
    if p.use_distributed_optimizer:
        # A MoE model's routed experts (trained unless LoRA freezes the base) are sharded over
        # the expert data-parallel group, DP / EP ranks; everything else over DP.
        ep = p.expert_model_parallel_size
        experts = 0 if role in lora_roles(cfg) else sum(
            expert_params(dims, tp, layer, ep) for layer in stage_layers(dims, pp, stage))
        optimizer = (math.ceil(opt_per_param * (trained - experts) / dp)
                     + math.ceil(opt_per_param * experts / max(dp // ep, 1)))

    tokens, samples = _micro_tokens(cfg, role)
    tokens = math.ceil(tokens / cp)
    per_token = activation_bytes_per_token_layer(dims, tp, p.sequence_parallel, b)
    if role in lora_roles(cfg):
        per_token += lora_activation_bytes_per_token_layer(dims, getattr(cfg, role).lora, tp,
                                                           p.sequence_parallel, b)
    per_layer = per_token * tokens
    if knobs.attention == "materialized":
        seq = cfg.data.max_prompt_length + cfg.data.max_response_length
        per_layer += 6 * (dims.num_attention_heads // tp) * seq * tokens
    layers = dims.num_layers // pp
    in_flight = min(pp - stage, _num_microbatches(cfg, role, dp))
    vpp = p.virtual_pipeline_model_parallel_size or 1
    interleave = 1 + (pp - 1) / (pp * vpp) if vpp > 1 else 1.0
    s = tp if p.sequence_parallel else 1
    if getattr(cfg, role).recompute_activations:
        kept = dims.hidden_size // s * b * tokens
        activations = int(kept * layers * in_flight * interleave) + per_layer
    else:
        activations = int(per_layer * layers * in_flight * interleave)
    out = {"parameters": b * n, "gradients": 4 * trained, "optimizer": optimizer,
           "activations": activations}
    if role == "actor" and stage == pp - 1:
        vocab_l = padded_vocab(dims, tp, cfg.model.make_vocab_size_divisible_by) // tp
        out["logits"] = 2 * 2 * tokens * vocab_l
        if role in lora_roles(cfg) and adapts_head(getattr(cfg, role).lora.target_modules):
            out["logits"] += tokens * getattr(cfg, role).lora.r * b  # the lm_head adapter's x·Aᵀ
    return out


def reward_model_dims(cfg: Config) -> dict[str, ModelDims]:
    """name -> shape of every reward_model source (its config.json; a dist checkpoint's is in
    hf_config/)."""
    out = {}
    for i, s in enumerate(cfg.reward.sources):
        if s.type == "reward_model" and s.path:
            path = local_dir(s.path, s.revision, f"reward.sources[{i}].path", download=False)
            hf = path if os.path.isfile(os.path.join(path, "config.json")) \
                else os.path.join(path, "hf_config")
            cfg_file = os.path.join(hf, "config.json")
            if not os.path.isfile(cfg_file):
                raise ConfigError(f"reward.sources[{i}].path={s.path}: neither an HF directory (no "
                                  "config.json) nor a dist checkpoint (no hf_config/config.json)")
            config = load_config_json(cfg_file)
            if not any(str(a).endswith("ForSequenceClassification")
                       for a in config.get("architectures") or []):
                raise ConfigError(f"reward.sources[{i}].path={s.path}: config.json's "
                                  "architectures name no *ForSequenceClassification model")
            out[s.name] = ModelDims.from_hf_config(config, cfg_file)
    return out


def reward_model_bytes(cfg: Config, stage: int) -> int:
    """Parameters of the reward models on one rank of `stage`: they run at the training layout
    and stay on the GPU (their score head is a [h, 1] row in the output layer's place)."""
    p, div = cfg.parallel, cfg.model.make_vocab_size_divisible_by
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    sources = {s.name: s for s in cfg.reward.sources}
    total = 0
    for name, dims in reward_model_dims(cfg).items():
        n = stage_params(dims, tp, pp, stage, div)
        if stage == pp - 1 and not (dims.tie_word_embeddings and pp == 1):
            n -= padded_vocab(dims, tp, div) // tp * dims.hidden_size - dims.hidden_size
        total += _dtype_bytes(sources[name].dtype) * n
    return total


def _resident_params(cfg: Config, dims: ModelDims, stage: int, roles: list[str],
                     reference_pass: bool = False, here=None) -> dict[str, int]:
    """Parameters of other models on the GPU during a phase (the reference's, with
    reference.offload_params, only during its own pass); the reward models' always. `here`: the
    roles on this GPU (placement), None for all."""
    out = {}
    rm = reward_model_bytes(cfg, stage) if here is None or "reward_model" in here else 0
    if rm:
        out["reward model parameters"] = rm
    for role in roles:
        if here is not None and role not in here:
            continue
        if role == "reference" and (not _reference_weights(cfg)
                                    or (cfg.reference.offload_params and not reference_pass)):
            continue
        if role == "critic" and not cfg.uses_critic:
            continue
        out[f"{role} parameters"] = _dtype_bytes(getattr(cfg, role).dtype) * role_params(cfg, dims, role, stage)
    return out


def _reward_pass(cfg: Config, dims: ModelDims, actor_params, idle_state, batch, here=None):
    """The reward models' scoring: one reward model's forward over a micro-batch at a time (the
    actor's micro-batch settings unless the source sets its own), the other models resident."""
    p = cfg.parallel
    sources = {s.name: s for s in cfg.reward.sources}

    def f(stage):
        per_layer = 0
        for name, rm_dims in reward_model_dims(cfg).items():
            s, seq = sources[name], cfg.data.max_prompt_length + cfg.data.max_response_length
            if s.max_tokens_per_microbatch:  # as build.build_reward_models chooses
                tokens = s.max_tokens_per_microbatch
            elif s.micro_batch_size:
                tokens = s.micro_batch_size * seq
            else:
                tokens = cfg.actor.max_tokens_per_microbatch or cfg.actor.micro_batch_size_per_gpu * seq
            per_layer = max(per_layer, tokens * activation_bytes_per_token_layer(
                rm_dims, p.tensor_model_parallel_size, p.sequence_parallel))
        return {**actor_params(stage), **_resident_params(cfg, dims, stage, ["reference", "critic"], here=here),
                **idle_state(stage), **batch, "reward model activations": per_layer}
    return f


def _uses_reference(cfg: Config) -> bool:
    """The reference model is only built when some KL term needs its log-probs."""
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def _reference_weights(cfg: Config) -> bool:
    """The reference has weights of its own: it is used, and it is not the actor's model with
    its adapters off (actor.lora)."""
    return _uses_reference(cfg) and not cfg.actor.lora.enable


def generation_bytes(cfg: Config, dims: ModelDims, world: int, knobs: Knobs,
                     own_set: bool = False) -> dict[str, int]:
    """Per-GPU bytes of the engine's share of the generation phase on `world` generation GPUs;
    `own_set`: a rollout set of its own (placement.rollout), whose weights are always a copy."""
    p, r, d = cfg.parallel, cfg.rollout, cfg.data
    tp_g = r.tensor_parallel_size
    dp_g = world // tp_g
    tp_t, div = p.tensor_model_parallel_size, cfg.model.make_vocab_size_divisible_by
    if tp_g == tp_t and p.pipeline_model_parallel_size == 1 and not cfg.actor.lora.enable \
            and not own_set and not dims.num_experts:
        weights = 0  # the training layout already is the generation layout
    else:  # bf16, every layer of this rank's TP_g slice, vocabulary padded as training pads it;
        # with LoRA always a copy of its own, holding the merged W + (alpha/r)·B·A; a MoE
        # model's always (every expert, stacked per layer: build.build_generation_model)
        weights = 2 * stage_params(dims, tp_g, 1, 0, div, vocab_tp=tp_t)
    seqs = math.ceil(d.train_batch_size * r.n / dp_g)
    concurrent = min(r.max_num_seqs, seqs)
    seq_len = d.max_prompt_length + d.max_response_length
    kv_g = max(dims.num_key_value_heads // tp_g, 1)
    kv_cache = 2 * dims.num_layers * kv_g * dims.head_dim * 2 * seq_len * concurrent
    # Every rank samples from the full vocabulary: the TP_g logit shards are all-gathered first.
    sampling = 3 * 4 * concurrent * padded_vocab(dims, tp_t, div)
    chunk = min(PREFILL_CHUNK_TOKENS, concurrent * d.max_prompt_length)
    prefill = chunk * activation_bytes_per_token_layer(dims, tp_g, False)
    return {"generation weights": weights, "KV cache": kv_cache, "engine overhead": sampling + prefill}


def plan_memory(cfg: Config, dims: ModelDims, world: int, knobs: Knobs, here=None) -> dict:
    """Per-GPU bytes per component for each phase, at the stage where the phase peaks.

    Returns {phase: {"stage": int, "components": {name: bytes}, "total": bytes}} plus "host"
    ({"per_gpu": {name: bytes}, "per_node": bytes}). The lead compares these with measured peaks.
    `here`: the roles on these GPUs (a placement's set: `plan_memory_by_set`), None for every
    role; only their models and their phases count.
    """
    roles_here = set(here) if here is not None else None

    def on(role: str) -> bool:
        return roles_here is None or role in roles_here

    p = cfg.parallel
    pp = p.pipeline_model_parallel_size
    runtime = int(RUNTIME_OVERHEAD_GIB * GiB)
    phases: dict[str, dict] = {}

    def best(name: str, per_stage) -> None:
        candidates = []
        for stage in range(pp):
            comps = dict(per_stage(stage))
            comps["runtime"] = runtime
            candidates.append((sum(comps.values()), stage, comps))
        total, stage, comps = max(candidates, key=lambda c: c[0])
        phases[name] = {"stage": stage, "components": comps, "total": total}

    trained = [r for r in ["actor"] + (["critic"] if cfg.uses_critic else []) if on(r)]

    def actor_params(stage):
        if not on("actor"):
            return {}
        t = training_bytes(cfg, dims, world, "actor", stage, knobs)
        return {"actor parameters": t["parameters"]}

    def idle_state(stage, busy: Optional[str] = None) -> dict[str, int]:
        """Gradients and optimizer states of models not being updated: on the GPU without offload."""
        if knobs.offload:
            return {}
        out = {}
        for role in trained:
            if role != busy:
                t = training_bytes(cfg, dims, world, role, stage, knobs)
                out[f"{role} gradients"], out[f"{role} optimizer"] = t["gradients"], t["optimizer"]
        return out

    if on("actor"):
        best("generate", lambda s: {**actor_params(s), **_resident_params(cfg, dims, s, ["reference", "critic"], here=here),
                                    **idle_state(s), **generation_bytes(cfg, dims, world, knobs)})

    batch = {"rollout batch": rollout_batch_bytes(cfg)}

    def forward_pass(role):
        """A forward-only pass of `role` over the batch: one layer's activations of a
        micro-batch at a time, plus (log-prob passes) that micro-batch's logits."""
        def f(stage):
            tokens = math.ceil(_micro_tokens(cfg, "critic" if role == "critic" else "actor")[0]
                               / p.context_parallel_size)
            per_layer = activation_bytes_per_token_layer(dims, p.tensor_model_parallel_size,
                                                         p.sequence_parallel) * tokens
            comps = {**actor_params(stage), **_resident_params(cfg, dims, stage, ["reference", "critic"],
                                                               reference_pass=role == "reference", here=here),
                     **idle_state(stage), **batch, "forward activations": per_layer}
            t = training_bytes(cfg, dims, world, "actor", stage, knobs)
            if role != "critic" and "logits" in t:
                comps["logits"] = t["logits"] // 2
            return comps
        return f

    # score: the log-prob passes (old log-probs of the actor, the reference's); the reference's
    # weights are on the GPU for it even when offloaded between uses.
    if on("actor") or (_uses_reference(cfg) and on("reference")):
        best("score", forward_pass("reference" if _uses_reference(cfg) and on("reference") else "actor"))
    if cfg.critic_values_pass and on("critic"):
        best("values", forward_pass("critic"))
    if reward_model_dims(cfg) and on("reward_model"):
        best("reward", _reward_pass(cfg, dims, actor_params, idle_state, batch, here=here))

    def update(role, others):
        def f(stage):
            t = training_bytes(cfg, dims, world, role, stage, knobs)
            return ({f"{role} {k}": v for k, v in t.items()} | _resident_params(cfg, dims, stage, others, here=here)
                    | idle_state(stage, busy=role) | batch)
        return f

    if on("actor"):
        best("actor_update", update("actor", ["reference", "critic"]))
    if cfg.uses_critic and on("critic"):
        best("critic_update", lambda s: {**update("critic", ["reference"])(s), **actor_params(s)})

    host = {}
    for stage in range(pp):
        per = {}
        for role in trained if knobs.offload else []:
            t = training_bytes(cfg, dims, world, role, stage, knobs)
            per[f"{role} gradients"] = t["gradients"]
            per[f"{role} optimizer"] = t["optimizer"]
        if cfg.reference.offload_params and _reference_weights(cfg) and on("reference"):
            per["reference parameters"] = (_dtype_bytes(cfg.reference.dtype)
                                           * role_params(cfg, dims, "reference", stage))
        if not host or sum(per.values()) > sum(host.values()):
            host = per
    phases["host"] = {"per_gpu": host, "per_node": sum(host.values()) * knobs.gpus_per_node}
    return phases


def plan_memory_by_set(cfg: Config, dims: ModelDims, world: int, knobs: Knobs,
                       gpus_per_node: Optional[int] = None) -> dict[str, dict]:
    """plan_memory for each role set of placement.* ({"actor+reference": plan, "critic": ...}):
    each set at its own layout and size, counting only its roles' models and phases. Colocated:
    one entry, "all", the plan of every role on every GPU."""
    placement = Placement.resolve(cfg, world, gpus_per_node)
    if placement.colocated:
        return {"all": plan_memory(cfg, dims, world, knobs)}
    out = {}
    for s in placement.distinct_sets():
        roles = [r for r, t in placement.sets.items() if t == s]
        p = replace(cfg.parallel, tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp,
                    virtual_pipeline_model_parallel_size=s.vpp)
        out["+".join(roles)] = plan_memory(replace(cfg, parallel=p), dims, len(s.ranks), knobs, here=roles)
    return out


def plan_job_memory(cfg: Config, dims: ModelDims, world: int, knobs: Knobs) -> dict:
    """plan_memory of the job: colocated, the plan itself; placed, every set's phases as
    "<set>/<phase>" in one plan, its "host" the largest set's per GPU (for misfits and the
    offload choice, which then hold for every set)."""
    plans = plan_memory_by_set(cfg, dims, world, knobs, knobs.gpus_per_node)
    if list(plans) == ["all"]:
        return plans["all"]
    out: dict = {}
    host = {"per_gpu": {}, "per_node": 0}
    for name, plan in plans.items():
        out.update({f"{name}/{phase}": ph for phase, ph in plan.items() if phase != "host"})
        if plan["host"]["per_node"] > host["per_node"]:
            host = plan["host"]
    out["host"] = host
    return out


def misfits(memory: dict, knobs: Knobs) -> list[str]:
    """Phases over the usable GPU memory, and host memory over its limit."""
    usable = knobs.gpu_memory_gib * USABLE_FRACTION * GiB
    bad = [name for name, ph in memory.items() if name != "host" and ph["total"] > usable]
    if knobs.host_memory_gib is not None and memory["host"]["per_node"] > knobs.host_memory_gib * GiB:
        bad.append("host")
    return bad


def peak_phase(memory: dict) -> str:
    """The phase of a plan with the highest total."""
    return max((n for n in memory if n != "host"), key=lambda n: memory[n]["total"])


def choose_offload(cfg: Config, dims: ModelDims, world: int, knobs: Knobs) -> tuple[bool, str]:
    """trainer.offload_between_phases resolved to (offload?, why).

    true / false are taken as set. "auto" offloads only when some phase would not fit with every
    model's gradients and optimizer states kept on the GPU: host round trips cost seconds per
    step (10.8 s of a 38.8 s GRPO step at 1.5B on one H200, bench/RESULTS.md) and buy nothing
    when the memory is there.
    """
    setting = cfg.trainer.offload_between_phases
    if setting != "auto":
        return bool(setting), f"trainer.offload_between_phases={str(setting).lower()}"
    kept = replace(knobs, offload=False, host_memory_gib=None)
    memory = plan_job_memory(cfg, dims, world, kept)
    usable = knobs.gpu_memory_gib * USABLE_FRACTION
    bad = misfits(memory, kept)
    peak = peak_phase(memory)
    if bad:
        worst = max(bad, key=lambda n: memory[n]["total"])
        return True, (f"auto: with gradients and optimizer states on the GPU, {worst} would need "
                      f"{memory[worst]['total'] / GiB:.1f} GiB of {usable:.1f} usable")
    return False, (f"auto: every phase fits with gradients and optimizer states on the GPU "
                   f"(peak {peak} {memory[peak]['total'] / GiB:.1f} GiB of {usable:.1f} usable)")


def plan_with_offload_choice(cfg: Config, dims: ModelDims, world: int,
                             knobs: Knobs) -> tuple[bool, str, dict]:
    """(offload?, why, memory plan with that choice): what the trainer (build.resolve_offload),
    this CLI and the benchmarks report."""
    offload, why = choose_offload(cfg, dims, world, knobs)
    return offload, why, plan_job_memory(cfg, dims, world, replace(knobs, offload=offload))


# Token budgets for a role with no micro-batch setting (choose_token_budgets). Past
# BUDGET_CAP_TOKENS a micro-batch's matrix products run as fast per token as they get, and more
# memory only saves launches; below BUDGET_EFFICIENT_TOKENS small models lose time to per-micro-
# batch overheads, so "auto" offload is worth taking before a budget that small (bench/RESULTS.md
# 2026-12-07, the real-model GRPO recipe on an H100: 32,768 and 65,536 tokens equally fast, 4,096
# 1.4x slower a step).
BUDGET_CAP_TOKENS = 32768
BUDGET_EFFICIENT_TOKENS = 4096


def budget_roles(cfg: Config) -> list[str]:
    """The trained roles whose token budget the planner chooses: neither
    micro_batch_size_per_gpu nor max_tokens_per_microbatch set (config.schema)."""
    roles = ["actor"] + (["critic"] if cfg.uses_critic else [])
    return [r for r in roles if planner_micro_batches(getattr(cfg, r))]


def budget_ladder(cfg: Config, world: int, roles: list[str]) -> list[int]:
    """The budgets to try, largest first: one rank's share of the largest mini-batch at full
    length (no micro-batch can hold more; a larger budget would only inflate the estimate), at
    most BUDGET_CAP_TOKENS, then the powers of two below it down to one full sequence (the
    smallest budget that holds every sample)."""
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    dp = data_parallel_size(cfg, world)
    most = 0
    for role in roles:
        r = getattr(cfg, role)
        mini = (getattr(r, "ppo_mini_batch_size", None) or cfg.actor.ppo_mini_batch_size) * cfg.rollout.n
        most = max(most, max(mini // dp, 1) * seq)
    top = max(seq, min(BUDGET_CAP_TOKENS, most))
    ladder, t = [top], 1 << ((top - 1).bit_length() - 1)  # the power of two below top
    while t > seq:
        if t < top:
            ladder.append(t)
        t //= 2
    if ladder[-1] != seq:
        ladder.append(seq)
    return ladder


def ladder_text(ladder: list[int]) -> str:
    return str(ladder[0]) if len(ladder) == 1 else f"{ladder[0]}, {ladder[1]}, ... {ladder[-1]}"


def with_token_budget(cfg: Config, roles: list[str], tokens: int) -> Config:
    """`cfg` with max_tokens_per_microbatch = `tokens` for `roles`."""
    return replace(cfg, **{role: replace(getattr(cfg, role), max_tokens_per_microbatch=tokens)
                           for role in roles})


def choose_token_budgets(cfg: Config, dims: ModelDims, world: int,
                         knobs: Knobs) -> tuple[Config, dict[str, str]]:
    """`cfg` with a token budget for every role left to the planner (budget_roles), and
    {role: why} for those roles.

    The budget is the largest of budget_ladder whose phases all fit the GPU (misfits) with
    trainer.offload_between_phases as set. Under "auto", a budget of at least
    BUDGET_EFFICIENT_TOKENS with gradients and optimizer states kept on the GPU comes first
    (host round trips cost seconds a step), then the largest that fits with offloading. When
    none fits, one full sequence, and the trainer's offload check reports what does not fit.
    Actor and critic share the budget: they are the same network but for the head.
    """
    roles = budget_roles(cfg)
    if not roles:
        return cfg, {}
    ladder = budget_ladder(cfg, world, roles)
    usable = knobs.gpu_memory_gib * USABLE_FRACTION

    def peak_if_fits(tokens: int, offload: bool) -> Optional[tuple[str, float]]:
        memory = plan_job_memory(with_token_budget(cfg, roles, tokens), dims, world,
                                 replace(knobs, offload=offload, host_memory_gib=None))
        if [n for n in misfits(memory, knobs) if n != "host"]:
            return None
        peak = peak_phase(memory)
        return peak, memory[peak]["total"] / GiB

    setting = cfg.trainer.offload_between_phases
    if setting == "auto":
        passes = [(False, min(BUDGET_EFFICIENT_TOKENS, ladder[0])), (True, 0)]
    else:
        passes = [(bool(setting), 0)]
    for offload, least in passes:
        for tokens in ladder:
            if tokens < least:
                break
            fit = peak_if_fits(tokens, offload)
            if fit is not None:
                state = ("with gradients and optimizer states offloaded between phases" if offload
                         else "with gradients and optimizer states on the GPU")
                why = (f"the largest budget of {ladder_text(ladder)} tokens whose phases fit "
                       f"{usable:.1f} usable GiB {state}; peak {fit[0]} {fit[1]:.1f} GiB")
                return with_token_budget(cfg, roles, tokens), dict.fromkeys(roles, why)
    why = (f"no budget of {ladder_text(ladder)} tokens fits {usable:.1f} usable GiB: one "
           "full sequence")
    return with_token_budget(cfg, roles, ladder[-1]), dict.fromkeys(roles, why)


def micro_batch_json(cfg: Config, chosen: dict[str, str]) -> dict[str, dict]:
    """{role: {"path": "packed" | "padded", "tokens" | "samples": n, "why": ...}} of every
    trained role (`chosen`: {role: why} of the budgets choose_token_budgets set)."""
    out = {}
    for role in ["actor"] + (["critic"] if cfg.uses_critic else []):
        r = getattr(cfg, role)
        if padded_micro_batches(r):
            out[role] = {"path": "padded", "samples": r.micro_batch_size_per_gpu,
                         "why": f"{role}.micro_batch_size_per_gpu as set; leave it and "
                                f"{role}.max_tokens_per_microbatch unset for packed token budgets"}
        else:
            out[role] = {"path": "packed", "tokens": r.max_tokens_per_microbatch,
                         "why": (f"planner: {chosen[role]}" if role in chosen
                                 else f"{role}.max_tokens_per_microbatch as set")}
    return out


def micro_batch_report(cfg: Config, chosen: dict[str, str]) -> list[str]:
    """micro_batch_json as one line per role, for the log and this CLI."""
    return [f"{role}: {m['path']} micro-batches of "
            + (f"{m['samples']} samples" if m["path"] == "padded" else f"{m['tokens']} tokens")
            + f" ({m['why']})" for role, m in micro_batch_json(cfg, chosen).items()]


def lora_savings(cfg: Config, dims: ModelDims, world: int, knobs: Knobs, memory: dict) -> dict:
    """What LoRA saves per GPU: the peak phase of `memory` (this config's plan) against that of
    the same config with every lora off, planned as this CLI would plan it (its own offload
    choice under "auto"). Returns {"trainable_params": {role: n}, "peak_phase", "peak_bytes",
    "peak_phase_without", "peak_bytes_without", "saved_bytes"}."""
    off = replace(cfg, actor=replace(cfg.actor, lora=replace(cfg.actor.lora, enable=False)),
                  critic=replace(cfg.critic, lora=replace(cfg.critic.lora, enable=False)))
    full = plan_with_offload_choice(off, dims, world, knobs)[2]
    peak, peak_full = peak_phase(memory), peak_phase(full)
    return {"trainable_params": {r: lora_trainable_params(dims, getattr(cfg, r).lora, r)
                                 for r in lora_roles(cfg)},
            "peak_phase": peak, "peak_bytes": memory[peak]["total"],
            "peak_phase_without": peak_full, "peak_bytes_without": full[peak_full]["total"],
            "saved_bytes": full[peak_full]["total"] - memory[peak]["total"]}


# ---------------------------------------------------------------------------------------------
# Suggestions: re-plan with one knob changed
# ---------------------------------------------------------------------------------------------

def _candidates(cfg: Config, world: int, nodes: int,
                gpus_per_node: int) -> list[tuple[str, list[str], int]]:
    """(description, overrides, world) for single changes that reduce memory."""
    p, a, c, r = cfg.parallel, cfg.actor, cfg.critic, cfg.rollout
    out = []
    if not p.use_distributed_optimizer:
        out.append(("parallel.use_distributed_optimizer=true", ["parallel.use_distributed_optimizer=true"], world))
    roles = [("actor", a)] + ([("critic", c)] if cfg.uses_critic else [])
    # Actor and critic have the same shape: change both together.
    rec = [f"{role}.recompute_activations=true" for role, rc in roles if not rc.recompute_activations]
    if rec:
        out.append((" ".join(rec), rec, world))
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        out.append(("parallel.sequence_parallel=true", ["parallel.sequence_parallel=true"], world))
    pp2 = p.pipeline_model_parallel_size * 2
    out.append((f"parallel.pipeline_model_parallel_size={pp2}",
                [f"parallel.pipeline_model_parallel_size={pp2}"], world))
    tp2 = p.tensor_model_parallel_size * 2
    if tp2 <= gpus_per_node:  # TP across nodes would put its all-reduces on the network
        out.append((f"parallel.tensor_model_parallel_size={tp2}",
                    [f"parallel.tensor_model_parallel_size={tp2}"], world))
    smaller = []
    for role, rc in roles:
        if rc.max_tokens_per_microbatch:
            smaller.append(f"{role}.max_tokens_per_microbatch={rc.max_tokens_per_microbatch // 2}")
        elif rc.micro_batch_size_per_gpu > 1:
            smaller.append(f"{role}.micro_batch_size_per_gpu={rc.micro_batch_size_per_gpu // 2}")
    if smaller:
        out.append((" ".join(smaller), smaller, world))
    if cfg.trainer.offload_between_phases is False:
        out.append(("trainer.offload_between_phases=auto", ["trainer.offload_between_phases=auto"], world))
    if _reference_weights(cfg) and not cfg.reference.offload_params:
        out.append(("reference.offload_params=true", ["reference.offload_params=true"], world))
    if r.max_num_seqs > 1:
        out.append((f"rollout.max_num_seqs={r.max_num_seqs // 2}", [f"rollout.max_num_seqs={r.max_num_seqs // 2}"], world))
    if r.tensor_parallel_size * 2 <= p.tensor_model_parallel_size:
        out.append((f"rollout.tensor_parallel_size={r.tensor_parallel_size * 2}",
                    [f"rollout.tensor_parallel_size={r.tensor_parallel_size * 2}"], world))
    out.append((f"--nodes {nodes * 2}", [], world * 2))
    return out


def suggest(cfg: Config, overrides: list[str], config_path: Optional[str], dims: ModelDims,
            world: int, nodes: int, knobs: Knobs, failing: list[str]) -> dict[str, list[str]]:
    """Re-plan with changed knobs. Returns {"fixes": single changes after which everything fits,
    "pairs": (only when no single change is enough) pairs that fit, "helps": single changes that
    reduce a failing phase, with the GiB they save, largest first}."""
    base = plan_job_memory(cfg, dims, world, knobs)

    def trial(changes):
        extra = [o for _, ovr, _ in changes for o in ovr]
        w = world * math.prod(cw // world for _, _, cw in changes)
        try:
            t = Config.load(config_path, overrides + extra)
            validate(t, w, dims.shape())
        except ConfigError:
            return None  # this change breaks a divisibility rule here
        t = choose_token_budgets(t, dims, w, knobs)[0]
        return plan_job_memory(t, dims, w, replace(knobs, offload=choose_offload(t, dims, w, knobs)[0]))

    cands = _candidates(cfg, world, nodes, knobs.gpus_per_node)
    fixes, helps, useful = [], [], []
    for cand in cands:
        mem = trial([cand])
        if mem is None:
            continue
        if not misfits(mem, knobs):
            fixes.append(cand[0])
            continue
        gpu = [ph for ph in failing if ph != "host"]
        saved = (max(base[ph]["total"] - mem[ph]["total"] for ph in gpu) if gpu
                 else base["host"]["per_node"] - mem["host"]["per_node"])
        if saved > 0:
            helps.append((saved, cand[0]))
            useful.append(cand)
    pairs = []
    if not fixes:
        for i, a in enumerate(useful):
            for b in useful[i + 1:]:
                mem = trial([a, b])
                if mem is not None and not misfits(mem, knobs):
                    pairs.append(f"{a[0]} + {b[0]}")
    return {"fixes": fixes, "pairs": pairs[:6],
            "helps": [f"{d} (-{s / GiB:.1f} GiB)" for s, d in sorted(helps, reverse=True)]}
