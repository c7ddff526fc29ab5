"""Write a tiny, randomly initialised Hugging Face model directory (config, safetensors, tokenizer).

    python -m tools.make_tiny_model --out runs/quickstart/tiny_model     # from a checkout
    python -m verl_mcore.tiny_model --out runs/quickstart/tiny_model     # also when installed

The quickstart trains this model, so the real path runs end to end on a laptop CPU with no
downloads: HF config.json + safetensors -> megatron-core GPTModel -> RL -> HF export. See
`build_tokenizer` for the tokenizer. The quickstart config sets `model.make_tiny_if_missing`, so
its first run writes the model itself (`ensure_tiny_model`); the model is the same either way
(seed 0, the defaults below).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import time

from verl_mcore.config import ConfigError
from verl_mcore.models.hub import is_hub_id

# The tokenizer is a byte-level BPE in Qwen2's format (Qwen2's pre-tokenizer regex), trained on the
# quickstart's phrases: about 36 tokens. It is saved as a `Qwen2Tokenizer` because transformers 5's
# AutoTokenizer rebuilds a qwen2 model's tokenizer through that class whatever tokenizer.json says.
CORPUS = [f"repeat the digit {d} : {str(d) * 4}" for d in range(10)]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# The one model.path model.make_tiny_if_missing writes to: configs/quickstart.yaml's, relative to
# the current directory as that config names it (ensure_tiny_model says why only there).
QUICKSTART_PATH = "runs/quickstart/tiny_model"


def build_tokenizer(vocab_size: int = 40):
    import json

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  show_progress=False)
    bpe.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_model(out: str, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 128, max_positions: int = 128,
                    reward_model: bool = False, initializer_range: float = 0.02,
                    moe: bool = False) -> str:
    """reward_model: a Qwen2ForSequenceClassification with one label (a reward model with the
    quickstart's tokenizer) instead of the causal LM. initializer_range: the std of the random
    weights (transformers' default 0.02 leaves this small a model's logits nearly uniform, and
    a frozen head at that scale caps what adapters on the other layers can learn).
    moe: a Qwen2-MoE causal LM instead (4 experts of ffn / 2, top-2, a shared expert of ffn / 2
    with its gate, the load-balancing loss at transformers' default coefficient): the
    mixture-of-experts path end to end at the quickstart's size."""
    import torch
    from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification,
                              Qwen2MoeConfig, Qwen2MoeForCausalLM)

    tokenizer = build_tokenizer()
    kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, initializer_range=initializer_range,
    )
    if moe and reward_model:
        raise ValueError("make_tiny_model: moe and reward_model together are not made")
    if moe:
        config = Qwen2MoeConfig(**kwargs, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=ffn // 2,
                                shared_expert_intermediate_size=ffn // 2, norm_topk_prob=False,
                                output_router_logits=True)
    else:
        config = Qwen2Config(**kwargs, num_labels=1) if reward_model else Qwen2Config(**kwargs)
    torch.manual_seed(seed)
    cls = (Qwen2MoeForCausalLM if moe else Qwen2ForSequenceClassification if reward_model
           else Qwen2ForCausalLM)
    model = cls(config).to(torch.float32)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def write_tiny_model_atomic(out: str, **kwargs) -> bool:
    """make_tiny_model(out, **kwargs) into a temporary sibling renamed to `out` at the end, so a
    killed run never leaves a directory that looks like a model. False: `out` appeared meanwhile
    (another node of a job on a shared filesystem won the rename; the model is the same)."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    # Hidden, and named by host and pid: writers on several nodes never share a temporary.
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-{socket.gethostname()}-{os.getpid()}-",
                           dir=parent)
    try:
        make_tiny_model(tmp, **kwargs)
        try:
            os.rename(tmp, out)
        except OSError as e:
            if os.path.isfile(os.path.join(out, "config.json")):
                return False
            raise FileExistsError(f"{out} exists and is not empty ({e.strerror}); the tiny model "
                                  "is written only to a new or empty directory") from e
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_tiny_model(model, local_rank: int, timeout_s: float = 600.0,
                      write: bool = True) -> bool:
    """model.make_tiny_if_missing (`model`: the config's ModelConfig): write the tiny model at
    model.path unless a model is there. Local rank 0 of each node writes it; the node's other
    ranks wait for the rename (they poll the filesystem: no collective, so a rank that fails
    here never leaves the others waiting in one). Raises ConfigError naming the key.

    Only at QUICKSTART_PATH: a user who copies the quickstart config keeps the flag, and a
    mistyped model.path of theirs must stop the run, not train a random model and exit 0.

    write=False checks the same and writes nothing (the preflight, while the data is wrong):
    False when the model is still to be written, else True."""
    if not model.make_tiny_if_missing:
        return True
    if not model.path:
        raise ConfigError("model.make_tiny_if_missing=true needs model.path: the directory to "
                          "write the tiny model to")

    path, config = model.path, os.path.join(model.path, "config.json")
    if os.path.isfile(config) or is_hub_id(path):  # a Hub id names a model, not a place to write
        return True
    if os.path.abspath(path) != os.path.abspath(QUICKSTART_PATH):
        raise ConfigError(
            f"model.path={path} holds no model (no config.json there), and "
            f"model.make_tiny_if_missing=true writes the quickstart's random tiny model only at "
            f"the quickstart's own path {QUICKSTART_PATH}: set model.path to your model's "
            f"directory or Hub id (and model.make_tiny_if_missing=false); to train a tiny random "
            f"model there on purpose, write it first with "
            f"`python -m verl_mcore.tiny_model --out {path}`")
    if os.path.exists(path):
        raise ConfigError(
            f"model.path={path} exists but holds no config.json; model.make_tiny_if_missing "
            "writes only a directory that does not exist yet: remove it, or point model.path "
            "at a Hugging Face model directory")
    if not write:
        return False
    if local_rank == 0:
        try:
            wrote = write_tiny_model_atomic(path)
        except OSError as e:
            raise ConfigError(f"model.make_tiny_if_missing: writing the tiny model to "
                              f"model.path={path} failed: {e}") from e
        if wrote:
            print(f"model.make_tiny_if_missing: wrote the quickstart's tiny model to {path}",
                  flush=True)
        return True
    deadline = time.monotonic() + timeout_s
    while not os.path.isfile(config):
        if time.monotonic() > deadline:
            raise ConfigError(
                f"model.make_tiny_if_missing: local rank 0 of this node did not write the tiny "
                f"model at model.path={path} within {timeout_s:.0f} s; see that rank's error")
        time.sleep(0.2)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write (created)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--initializer-range", type=float, default=0.02,
                   help="std of the random weights (0.08 gives a head that LoRA alone can steer)")
    p.add_argument("--reward-model", action="store_true",
                   help="a sequence classifier with one label (a reward model) instead")
    p.add_argument("--moe", action="store_true",
                   help="a Qwen2-MoE model (4 experts, top-2, a shared expert) instead")
    args = p.parse_args(argv)
    if os.path.exists(os.path.join(args.out, "config.json")):
        print(f"{args.out} already holds a model; leaving it as it is")
        return 0
    write_tiny_model_atomic(args.out, seed=args.seed, hidden=args.hidden, layers=args.layers,
                            reward_model=args.reward_model,
                            initializer_range=args.initializer_range, moe=args.moe)
    kind = "reward model" if args.reward_model else "MoE model" if args.moe else "model"
    print(f"wrote a tiny random Qwen2-architecture {kind} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
