"""Hugging Face config.json -> the architecture we build in megatron-core, and its TransformerConfig.

Supported: Llama 2 / 3 / 3.1 (`rope_type` default or llama3), Mistral (no sliding window in use),
Qwen2 / Qwen2.5 (QKV bias, tied embeddings in small sizes), Qwen3 (q/k RMSNorm per head), and the
mixture-of-experts families Qwen2-MoE (a shared expert with a sigmoid gate), Qwen3-MoE and Mixtral
(`MoESpec`; the router's semantics and how megatron-core's are matched: `MoESpec`). Each of them
is a pre-norm decoder with RMSNorm, SwiGLU MLPs (or SwiGLU experts), RoPE (rotate-half) and GQA,
which is what `transformer_config` describes to megatron-core.

Anything in config.json that would change the math and that we do not build is refused here with
the field's name (`UnsupportedConfigError`), so a model is never silently different from the one
`transformers` would run.

RoPE settings come in two spellings: transformers >= 5 writes `rope_parameters` (with `rope_theta`
inside), older checkpoints carry `rope_theta` + `rope_scaling`; both are read.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import torch

from verl_mcore.models.hub import cache_advice, load_config_json
from verl_mcore.utils.device import cuda_in_use

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# Megatron's default divisor (make-vocab-size-divisible-by). HF vocabularies of the supported
# families (32000, 32768, 128256, 151936) are multiples of 128, so padding is usually a no-op.
DEFAULT_VOCAB_DIVISIBLE_BY = 128


class UnsupportedConfigError(ValueError):
    """A config.json field that would make our model differ from the Hugging Face one."""


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """RoPE frequencies: `theta` base, plus scaling parameters when `type` is not "default"."""

    type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts part of an HF config: which layers route, to how many experts.

    Router semantics, per family, and the megatron-core TransformerConfig that reproduces them
    (`moe_config`):

    - Qwen2-MoE / Qwen3-MoE: p = softmax(logits) over all experts (fp32), the top-k p are the
      weights; with `norm_topk_prob` they are divided by their sum. Without it that is megatron's
      `moe_router_pre_softmax=True` (softmax, then top-k, no renormalisation).
    - Mixtral (and Qwen with `norm_topk_prob`): the renormalised top-k of the softmax, which
      equals a softmax over the k largest logits: megatron's default order
      (`moe_router_pre_softmax=False`: top-k of the logits, then softmax over them). The two
      agree in exact arithmetic; in floating point they differ by rounding only, and the experts
      chosen differ only where two logits tie after the softmax's rounding.
    - Qwen2-MoE's shared expert (`shared_expert_intermediate_size`) runs on every token and is
      scaled by sigmoid(shared_expert_gate(x)): megatron's `moe_shared_expert_gate`, whose
      [1, H] weight is the HF gate's.
    - Dense layers among MoE layers (`mlp_only_layers`, `decoder_sparse_step`): megatron's
      `moe_layer_freq` as a 0/1 list; the dense layers keep `intermediate_size`.
    - Load balancing: HF (`output_router_logits`) adds router_aux_loss_coef * E * sum_e f_e P_e
      with f_e the fraction of the T * k selections that went to expert e and P_e the mean
      router probability, over the tokens of all MoE layers together (a mean over layers).
      Megatron's "aux_loss" adds, per MoE layer, coeff * E / (k T^2) * sum_e count_e * sum_t p_te
      = coeff / k * E * sum_e f_e P_e: the same with coeff = router_aux_loss_coef * k / L_moe
      (`aux_loss_coeff`). HF configs that train without it (output_router_logits false) map to 0.
    - The router runs in fp32 (`moe_router_dtype`), as HF's softmax does; HF computes the
      logits themselves in the model's dtype, so in bf16 they differ by rounding.
    """

    num_experts: int
    topk: int
    ffn_hidden_size: int
    norm_topk_prob: bool
    # Layers (global indices) whose MLP is the MoE block; the others are dense MLPs.
    layers: tuple[int, ...]
    shared_expert_ffn_hidden_size: int | None = None
    shared_expert_gate: bool = False
    aux_loss_coeff: float = 0.0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.layers


@dataclasses.dataclass(frozen=True)
class HFArch:
    """The parts of an HF causal-LM config that decide the math of the model we build."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    rope: RopeSpec
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    max_position_embeddings: int
    torch_dtype: str | None = None
    # HF *ForSequenceClassification checkpoints (reward models): number of `score` outputs.
    num_labels: int | None = None
    # Mixture-of-experts families; None for dense models.
    moe: MoESpec | None = None

    def padded_vocab_size(self, tp: int = 1, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
        return padded_vocab_size(self.vocab_size, tp, divisible_by)


def padded_vocab_size(vocab_size: int, tp: int = 1,
                      divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
    """Vocabulary rounded up to a multiple of lcm(divisible_by, tp).

    Megatron's own rule pads to `divisible_by * tp`, which changes the padded size (and so the
    embedding's global shape) with TP. With the lcm, the default 128 gives the same padded size at
    every TP that divides 128, so one converted checkpoint loads at any such TP.
    """
    multiple = math.lcm(divisible_by, tp)
    return int(math.ceil(vocab_size / multiple) * multiple)


def load_hf_config_dict(hf_dir: str | os.PathLike) -> dict[str, Any]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model "
                                f"directory){cache_advice(path)}")
    return load_config_json(path)


def generation_eos_ids(hf_dir: str | os.PathLike | None) -> tuple[int, ...]:
    """The end-of-sequence ids of the directory's generation_config.json (one id or a list;
    () when there is no such file or key). Instruct models often stop at more than the
    tokenizer's EOS (Qwen2.5-Instruct: <|im_end|> and <|endoftext|>), and transformers' generate
    stops at every one of them."""
    path = os.path.join(hf_dir, "generation_config.json") if hf_dir else None
    if not path or not os.path.isfile(path):
        return ()
    value = load_config_json(path).get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id {value!r} is not a token id or a list of them")
    return tuple(ids)


def _unsupported(source: str, field: str, value: Any, why: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"{source}: unsupported `{field}` = {value!r}: {why}")


def _read_rope(cfg: Mapping[str, Any], source: str) -> RopeSpec:
    params = cfg.get("rope_parameters")
    if params is not None:
        field = "rope_parameters"
        if isinstance(params, Mapping) and "rope_theta" not in params and "rope_type" not in params:
            # transformers 5 per-layer-type form: {"full_attention": {...}, "sliding_attention": ...}
            other = sorted(k for k in params if k != "full_attention")
            if other:
                raise _unsupported(source, "rope_parameters", other,
                                   "only full-attention layers are supported")
            params, field = params["full_attention"], "rope_parameters.full_attention"
        params = dict(params)
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        field = "rope_scaling"
        params = dict(cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _unsupported(source, f"{field}.rope_type", rope_type,
                           f"supported RoPE types are {list(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _unsupported(source, "partial_rotary_factor", partial, "only full rotary is supported")
    if rope_type == "default":
        return RopeSpec(theta=float(theta))
    if rope_type == "linear":
        return RopeSpec(type="linear", theta=float(theta), factor=float(params["factor"]))
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in params:
            raise UnsupportedConfigError(f"{source}: `{field}` of type llama3 lacks `{key}`")
    return RopeSpec(
        type="llama3", theta=float(theta), factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _check_sliding_window(cfg: Mapping[str, Any], source: str, max_seq_len: int | None) -> None:
    model_type = cfg["model_type"]
    layer_types = cfg.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        raise _unsupported(source, "layer_types", bad, "only full_attention layers are supported")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if cfg.get("use_sliding_window"):
            raise _unsupported(source, "use_sliding_window", True, "sliding-window attention "
                               "is not implemented")
        return
    window = cfg.get("sliding_window")
    if window is None:
        return
    # A window at least as long as every sequence we run is plain causal attention.
    if max_seq_len is not None and max_seq_len <= window:
        return
    raise _unsupported(
        source, "sliding_window", window,
        "sliding-window attention is not implemented; it is harmless only if every sequence is "
        f"at most {window} tokens: pass max_seq_len <= {window} (got {max_seq_len})",
    )


def _read_moe(cfg: Mapping[str, Any], source: str, num_layers: int) -> MoESpec:
    """The MoE fields of a qwen2_moe / qwen3_moe / mixtral config (see MoESpec)."""
    model_type = cfg["model_type"]
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; hub configs say
    # num_experts.
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not num_experts or "num_experts_per_tok" not in cfg:
        raise UnsupportedConfigError(f"{source}: a {model_type} config needs num_experts (or "
                                     "num_local_experts) and num_experts_per_tok")
    topk = int(cfg["num_experts_per_tok"])
    if model_type == "mixtral":
        if cfg.get("router_jitter_noise"):
            raise _unsupported(source, "router_jitter_noise", cfg["router_jitter_noise"],
                               "HF scales every MoE input by uniform noise in training; megatron's "
                               "moe_input_jitter_eps perturbs only the router's input")
        norm_topk, ffn, layers = True, int(cfg["intermediate_size"]), tuple(range(num_layers))
    else:
        norm_topk = bool(cfg.get("norm_topk_prob", False))
        ffn = int(cfg["moe_intermediate_size"])
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(num_layers)
                       if i not in dense and step > 0 and (i + 1) % step == 0)
    if not 1 <= topk <= int(num_experts):
        raise _unsupported(source, "num_experts_per_tok", topk,
                           f"must be between 1 and the number of experts ({num_experts})")
    if topk == 1 and norm_topk:
        # A renormalised top-1 weight is always 1; megatron's router has no such mode (a softmax
        # over one logit has no gradient, and it refuses it).
        raise _unsupported(source, "num_experts_per_tok", 1,
                           "top-1 routing with renormalised weights (norm_topk_prob / mixtral) has "
                           "no megatron-core router equivalent")
    shared = None
    if model_type == "qwen2_moe":
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) or None
    coeff = 0.0
    if cfg.get("output_router_logits") and layers:
        coeff = float(cfg.get("router_aux_loss_coef", 0.0)) * topk / len(layers)
    return MoESpec(num_experts=int(num_experts), topk=topk, ffn_hidden_size=ffn,
                   norm_topk_prob=norm_topk, layers=layers,
                   shared_expert_ffn_hidden_size=shared, shared_expert_gate=shared is not None,
                   aux_loss_coeff=coeff)


def read_hf_arch(config: Mapping[str, Any] | str | os.PathLike,
                 max_seq_len: int | None = None) -> HFArch:
    """Parse an HF config (a config.json dict, or a model directory) into an `HFArch`.

    `max_seq_len`: the longest sequence this run will feed the model; it only matters for
    configs with a sliding window (a window >= max_seq_len never takes effect).
    Raises UnsupportedConfigError naming the first field that we cannot build exactly.
    """
    if isinstance(config, Mapping):
        cfg, source = dict(config), "config.json"
    else:
        cfg, source = load_hf_config_dict(config), os.path.join(os.fspath(config), "config.json")
    missing = [f for f in ("num_attention_heads", "hidden_size", "num_hidden_layers",
                           "intermediate_size", "vocab_size") if f not in cfg]
    if missing:
        raise UnsupportedConfigError(f"{source}: missing field(s) {missing}: not a complete "
                                     "Hugging Face causal-LM config (model.path)")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(source, "model_type", model_type,
                           f"supported model types are {list(SUPPORTED_MODEL_TYPES)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _unsupported(source, "hidden_act", cfg["hidden_act"], "only SwiGLU (silu) MLPs")
    if cfg.get("mlp_bias"):
        raise _unsupported(source, "mlp_bias", True, "MLP biases are not implemented")
    # Llama/Mistral/Qwen3 `attention_bias` adds a bias to o_proj too, which megatron would only
    # build together with MLP biases; Qwen2 has q/k/v biases always and never an o_proj bias;
    # Qwen2-MoE has them as its `qkv_bias` says (default true), never on o_proj.
    qkv_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and cfg.get("qkv_bias", True))
    if model_type not in ("qwen2", "qwen2_moe") and cfg.get("attention_bias"):
        raise _unsupported(source, "attention_bias", True, "attention output biases are not "
                           "implemented (only Qwen2's fixed q/k/v biases are)")
    if cfg.get("quantization_config") is not None:
        raise _unsupported(source, "quantization_config", cfg["quantization_config"].get(
            "quant_method", "?"), "quantized checkpoints are not supported")
    _check_sliding_window(cfg, source, max_seq_len)
    rope = _read_rope(cfg, source)

    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    num_kv = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv:
        raise _unsupported(source, "num_key_value_heads", num_kv,
                           f"must divide num_attention_heads={num_heads}")
    archs = cfg.get("architectures") or []
    is_seq_cls = any(a.endswith("ForSequenceClassification") for a in archs)
    num_layers = int(cfg["num_hidden_layers"])
    return HFArch(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=int(head_dim),
        vocab_size=int(cfg["vocab_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope,
        qkv_bias=bool(qkv_bias),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        torch_dtype=cfg.get("dtype", cfg.get("torch_dtype")),
        num_labels=(len(cfg["id2label"]) if "id2label" in cfg else int(cfg.get("num_labels", 2)))
        if is_seq_cls else None,
        moe=_read_moe(cfg, source, num_layers) if model_type in MOE_MODEL_TYPES else None,
    )


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def transformer_config(arch: HFArch, *, tp: int = 1, pp: int = 1,
                       dtype: str | torch.dtype = torch.bfloat16, **overrides: Any):
    """megatron-core TransformerConfig for `arch` at a TP x PP layout.

    Dropout is off (RL scores and updates the exact model it samples from). `overrides` go
    straight to TransformerConfig (sequence_parallel, recompute_*, num_layers_in_first_pipeline_
    stage, ...).
    """
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = parse_dtype(dtype)
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not cuda_in_use(),
        # Fusions that need apex / TransformerEngine kernels stay off; the TE spec brings its own.
        # (A trainable engine turns gradient_accumulation_fusion on: it needs DDP's main_grad, and
        # models/grad_accum.py stands in for apex; see engine.role_config.)
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    if arch.moe is not None:
        kwargs.update(moe_config(arch.moe, arch.num_layers))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_config(moe: MoESpec, num_layers: int) -> dict[str, Any]:
    """TransformerConfig fields of a MoE architecture (the semantics: MoESpec).

    Experts run as megatron's SequentialMLP (one MLP per local expert; gpt.gpt_layer_spec), and
    tokens travel to their experts' EP ranks through the all-to-all dispatcher, without a
    capacity limit (no token is dropped).
    """
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.topk,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=moe.shared_expert_gate,
        # An int 1 when every layer routes: megatron then stacks the layers in its dist
        # checkpoints as for a dense model; a list makes it key every layer by its own index.
        moe_layer_freq=1 if len(moe.layers) == num_layers else
        [int(moe.is_moe_layer(i)) for i in range(num_layers)],
    )
