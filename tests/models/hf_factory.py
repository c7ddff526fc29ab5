"""Tiny random Hugging Face models for every supported family and quirk (no downloads).

Each family is built from its transformers config class, randomly initialised under a fixed seed
(norm weights and biases perturbed too, so a mapping that swaps or drops them shows up), and
written with `save_pretrained` in small shards (so the index path is exercised), together with a
tiny word-level tokenizer.

Shapes: 4 layers (PP=2 gives 2 + 2), hidden 64, 4 query heads over 2 KV groups (TP=2 gives one
group per rank), ffn 96, vocab 250 (not a multiple of 128: padding is exercised).
"""
from __future__ import annotations

import os

import torch

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=250, max_position_embeddings=256,
              rms_norm_eps=1e-6)

FAMILIES = ("llama2", "llama31", "mistral", "qwen2", "qwen2_untied", "qwen3")
# Mixture-of-experts families: top-2 of 4 or 8 experts (EP=2 gives 2 or 4 per rank).
# qwen2_moe: shared expert with its gate, softmax then top-k without renormalisation, layer 1
# dense (mlp_only_layers: megatron keys its layers one by one); qwen3_moe: renormalised top-k,
# q/k norms, all layers MoE; mixtral: renormalised top-k under its own names.
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")


def make_config(family: str, **overrides):
    import transformers as T

    kw = dict(COMMON)
    if family == "llama2":
        cls = T.LlamaConfig
        kw.update(rope_theta=10000.0)
    elif family == "llama31":
        # Non-default low/high frequency factors and original context: megatron's built-in
        # Llama-3 scaling hard-codes 1 / 4 / 8192 and would get these positions wrong.
        cls = T.LlamaConfig
        kw.update(rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
            "high_freq_factor": 8.0, "original_max_position_embeddings": 64})
    elif family == "mistral":
        cls = T.MistralConfig
        kw.update(sliding_window=None, rope_theta=1e6)
    elif family == "qwen2":
        cls = T.Qwen2Config
        kw.update(tie_word_embeddings=True)
    elif family == "qwen2_untied":
        cls = T.Qwen2Config
        kw.update(tie_word_embeddings=False)
    elif family == "qwen3":
        # head_dim 32 != hidden / heads: kv_channels must come from config.json.
        cls = T.Qwen3Config
        kw.update(head_dim=32, tie_word_embeddings=True)
    elif family == "qwen2_moe":
        cls = T.Qwen2MoeConfig
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
                  tie_word_embeddings=False)
    elif family == "qwen3_moe":
        cls = T.Qwen3MoeConfig
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                  norm_topk_prob=True, tie_word_embeddings=False)
    elif family == "mixtral":
        cls = T.MixtralConfig
        kw.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                  rope_theta=1e6)
    else:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES + MOE_FAMILIES}")
    kw.update(overrides)
    return cls(**kw)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.05 * noise)


def write_tokenizer(out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out_dir)


def save_tiny_model(family: str, out_dir: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                    seq_cls: bool = False, max_shard_size: str = "200KB", **overrides) -> str:
    """Write a tiny random `family` model (CausalLM, or SequenceClassification with one label)
    to `out_dir`; returns out_dir."""
    import transformers as T

    config = make_config(family, **overrides)
    torch.manual_seed(seed)
    if seq_cls:
        config.num_labels = 1
        model = T.AutoModelForSequenceClassification.from_config(config)
    else:
        model = T.AutoModelForCausalLM.from_config(config)
    randomize_(model, seed)
    model = model.to(dtype)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    write_tokenizer(out_dir, config.vocab_size)
    return out_dir

