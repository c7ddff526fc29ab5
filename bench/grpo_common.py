"""What bench_grpo_step.py (ours) and bench_trl_grpo.py (TRL) share, so both do the same work:
the random-weight model directory, its tokenizer, the prompts, the reward and the result table.

The model is a Hugging Face Qwen2 with random weights (Qwen2.5-1.5B's shape, or a tiny one for
CPU runs), saved as bf16 (GPU) or fp32 (CPU) safetensors with its tokenizer. The tokenizer is
the quickstart's 36-token byte-level BPE (tools/make_tiny_model.py) padded with filler tokens
(" 36", " 37", ...) up to the model's vocabulary, so every id a random model samples decodes to
text and the reward varies between samples. Filler tokens are never produced by encoding (no
merge leads to them), so a prompt of D digits is exactly D tokens (Qwen2's pre-tokenizer splits
digits one by one, and the chat template adds nothing).

Reward: the fraction of the response's digits that are the row's ground truth digit. Cheap on
both sides, and it gives GRPO groups a non-zero spread.

This file is also the reward file of our trainer (reward.custom_fn.path points here), so its
top level imports the standard library only.
"""
from __future__ import annotations

import math
import os
import random
import statistics

# Qwen2.5-1.5B (bench/bench_rollout.py QWEN25_1P5B; config.json of Qwen/Qwen2.5-1.5B), Qwen2.5-3B and a
# tiny model for CPU smoke runs. All tie the embeddings like Qwen2.5-1.5B.
SHAPES = {
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True),
    # Qwen2.5-3B (config.json of Qwen/Qwen2.5-3B).
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
               max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True),
}
DATA_SOURCE = "bench/digit_fraction"
TARGET_DIGIT = "7"


# ---------------------------------------------------------------------------------------------
# Model directory

def build_tokenizer(vocab_size: int):
    """The quickstart BPE plus filler tokens up to `vocab_size` (see the module docstring)."""
    import json

    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    from tools.make_tiny_model import build_tokenizer as quickstart_tokenizer

    base = quickstart_tokenizer()
    vocab = dict(base.get_vocab())
    # "Ġ" is byte-level BPE's space: filler token i decodes to " i".
    vocab.update({f"\u0120{i}": i for i in range(len(vocab), vocab_size)})
    model = json.loads(base.backend_tokenizer.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.chat_template = base.chat_template
    return tokenizer


def make_model_dir(out: str, shape: str, dtype: str, seed: int = 0, seq_cls: bool = False) -> str:
    """Write (once) a random HF Qwen2 model of `shape` with its tokenizer to `out` (seq_cls: a
    Qwen2ForSequenceClassification with one label, a reward model).

    An existing directory of the same shape and dtype is reused, so both benchmarks can share
    one (pass the same --workdir); a different one is an error rather than a silent mismatch.
    """
    import json

    import torch
    import transformers as T

    want = dict(SHAPES[shape])
    config_path = os.path.join(out, "config.json")
    if os.path.exists(config_path):
        with open(config_path) as f:
            have = json.load(f)
        wrong = {k: (have.get(k), v) for k, v in want.items()
                 if k != "rope_theta" and have.get(k) != v}
        saved = have.get("dtype", have.get("torch_dtype"))  # the key's name before transformers 5
        if saved != dtype:
            wrong["dtype"] = (saved, dtype)
        arch = "Qwen2ForSequenceClassification" if seq_cls else "Qwen2ForCausalLM"
        if have.get("architectures") != [arch]:
            wrong["architectures"] = (have.get("architectures"), [arch])
        if wrong:
            raise SystemExit(f"{out} holds another model ({wrong}: (found, wanted)); use another "
                             f"--workdir or delete it")
        return out
    tokenizer = build_tokenizer(want["vocab_size"])
    config = T.Qwen2Config(**want, dtype=dtype, pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    # Random init on the GPU when there is one: seconds instead of a minute for 1.5B on CPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if seq_cls:
        config.num_labels = 1
    with torch.device(device):
        cls = T.Qwen2ForSequenceClassification if seq_cls else T.Qwen2ForCausalLM
        model = cls(config).to(getattr(torch, dtype))
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# Prompts and reward

def prompt_rows(num: int, prompt_len: int, seed: int = 0) -> list[dict]:
    """`num` rows in our Parquet row layout; each prompt is `prompt_len` random digits, which
    the tokenizer above turns into exactly `prompt_len` tokens."""
    rng = random.Random(seed)
    return [{"prompt": "".join(rng.choice("0123456789") for _ in range(prompt_len)),
             "data_source": DATA_SOURCE,
             "reward_model": {"style": "rule", "ground_truth": TARGET_DIGIT}}
            for _ in range(num)]


def write_parquet(path: str, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def digit_fraction(text: str, digit: str) -> float:
    digits = [ch for ch in text if ch.isdigit()]
    return sum(ch == digit for ch in digits) / len(digits) if digits else 0.0


def score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """Our trainer's reward (reward.custom_fn.name=score)."""
    return digit_fraction(solution_str, ground_truth)


# ---------------------------------------------------------------------------------------------
# Results

def median_after_first(values: list[float]) -> float:
    """The median of every value but the first (warm-up: graph capture, allocator, autotuning);
    the only value when there is one."""
    values = [v for v in values if v is not None]
    if not values:
        return float("nan")
    return statistics.median(values[1:] if len(values) > 1 else values)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def json_safe(value):
    """`value` with non-finite floats as None (strict JSON) and unknown objects as strings."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)
