"""Which modules a LoRA adapter may sit on: the Hugging Face names, the megatron linears that hold
them, their shapes and how each adapter tensor is split over TP. Names and arithmetic only (no
torch): config validation and the memory planner read them without building anything;
models/lora.py builds the adapters from them.
"""
from __future__ import annotations

from typing import Optional, Sequence

# HF module -> (the megatron linear that holds it, the part of that linear's output rows)
HF_TARGETS = {
    "q_proj": ("self_attention.linear_qkv", "q"),
    "k_proj": ("self_attention.linear_qkv", "k"),
    "v_proj": ("self_attention.linear_qkv", "v"),
    "o_proj": ("self_attention.linear_proj", None),
    "gate_proj": ("mlp.linear_fc1", "gate"),
    "up_proj": ("mlp.linear_fc1", "up"),
    "down_proj": ("mlp.linear_fc2", None),
    "lm_head": ("output_layer", None),
}
# peft's name of the output layer: a target of its own, outside "all-linear" (as in peft), held
# by the last pipeline stage; its adapter's B has the padded vocabulary's rows (split over TP).
HEAD = "lm_head"
LAYER_TARGETS = tuple(t for t in HF_TARGETS if t != HEAD)
# Each megatron linear: its parts in output-row order, and whether it is row-parallel.
LINEARS = {
    "self_attention.linear_qkv": (("q_proj", "k_proj", "v_proj"), False),
    "self_attention.linear_proj": (("o_proj",), True),
    "mlp.linear_fc1": (("gate_proj", "up_proj"), False),
    "mlp.linear_fc2": (("down_proj",), True),
    "output_layer": ((HEAD,), False),
}


def resolve_targets(target_modules: str | Sequence[str]) -> tuple[str, ...]:
    """The HF module names to adapt, in HF_TARGETS order. "all-linear" is every linear of the
    decoder layers; as in peft it leaves out the output layer, which "lm_head" adds."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if "all-linear" in names:
        others = [n for n in names if n not in ("all-linear", HEAD)]
        if others:
            raise ValueError(f"lora.target_modules: 'all-linear' already names every linear of "
                             f"the layers; drop the others ({others})")
        return LAYER_TARGETS + ((HEAD,) if HEAD in names else ())
    unknown = [n for n in names if n not in HF_TARGETS]
    if unknown or not names:
        raise ValueError(f"lora.target_modules: {unknown or names} not among the adaptable "
                         f"modules {list(HF_TARGETS)} (or 'all-linear')")
    return tuple(t for t in HF_TARGETS if t in names)


def layer_targets(target_modules: str | Sequence[str]) -> tuple[str, ...]:
    """The targets inside the decoder layers (resolve_targets without lm_head)."""
    return tuple(t for t in resolve_targets(target_modules) if t != HEAD)


def adapts_head(target_modules: str | Sequence[str]) -> bool:
    """Whether lm_head (the output layer) is among the targets."""
    return HEAD in resolve_targets(target_modules)


def part_shapes(arch, target: str, vocab_rows: Optional[int] = None) -> tuple[int, int]:
    """(out, in) of an HF module, unsharded; lm_head's out is `vocab_rows` (the padded
    vocabulary of the megatron model) or else the HF vocabulary."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    if target == HEAD:
        return (vocab_rows or arch.vocab_size), h
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}[target]


def tp_shard_dim(target: str, which: str) -> Optional[int]:
    """The dimension an adapter tensor is split along over TP, None when replicated."""
    row_parallel = LINEARS[HF_TARGETS[target][0]][1]
    if row_parallel:
        return 1 if which == "A" else None
    return 0 if which == "B" else None
