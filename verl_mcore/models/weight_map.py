"""The one place that maps Hugging Face weights to megatron-core weights and back.

Used by the HF loader (`hf_weights.py`), the converter (`tools/convert_hf`) and rollout's weight
export. Everything here is a pure function of names and tensors: no process groups, no files.

Names. A megatron parameter has a *canonical* name: the GPTModel parameter name with the global
layer index, spelled as with the TransformerEngine spec (which is also the dist-checkpoint key
spelling megatron uses for the local spec), e.g. `decoder.layers.3.self_attention.linear_qkv.
layer_norm_weight` for the local spec's `decoder.layers.3.input_layernorm.weight`.

Layouts (H hidden, nh query heads, ng KV groups, hd head dim, r = nh / ng, F ffn, V vocab):
- linear_qkv [ng * (r + 2) * hd, H]: per KV group g, its r query heads, then k_g, then v_g
  (megatron's GQA interleaving). Its bias, when present, has the same row order.
- linear_fc1 [2F, H]: gate rows then up rows; megatron computes silu(gate) * up.
- word embeddings / output layer [V_pad, H]: HF rows then zero rows up to the padded size.

Mixture of experts (HFArch.moe): a MoE layer's MLP is a router `mlp.router.weight` [E, H] (HF
`mlp.gate.weight`; Mixtral `block_sparse_moe.gate.weight`), E experts, each a SwiGLU MLP whose
canonical names carry the *global* expert index, `mlp.experts.local_experts.<e>.linear_fc1.weight`
(gate rows then up rows, like a dense fc1) and `.linear_fc2.weight` (HF `mlp.experts.<e>.
{gate,up,down}_proj`; Mixtral `block_sparse_moe.experts.<e>.{w1,w3,w2}`), and for Qwen2-MoE a
shared expert `mlp.shared_experts.linear_fc1/linear_fc2.weight` with its sigmoid gate
`mlp.shared_experts.gate_weight` [1, H] (HF `mlp.shared_expert.*`, `mlp.shared_expert_gate`).
The layout is megatron's SequentialMLP (one module per expert, as the local spec builds it).

Expert parallelism: the experts split over EP ranks in contiguous blocks, rank r of R holding
experts [r * E / R, (r + 1) * E / R) whole (`expert_range`), under local indices 0.. in its
model. Within an expert, its fc1 / fc2 are TP-sliced like a dense MLP's, over the expert TP group
(megatron's expert_tensor_parallel_size, the TP size unless set). Router, shared expert gate and
norms are replicated; the shared expert is TP-sliced over the ordinary TP group.

TP slicing of the full (TP=1) tensor, for TP rank t of T:
- "qkv": rows [t * n / T, (t + 1) * n / T) (whole KV groups, so contiguous);
- "gate_up": the t-th row block of gate and of up, concatenated;
- "row": columns [t * n / T, ...);  "vocab": rows of the padded matrix;  "replicated": all of it.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator, Sequence

import torch

from verl_mcore.models.hf_config import HFArch

# Roles decide what the last stage's output layer is: the LM head (actor, reference), the HF
# `score` head of a *ForSequenceClassification checkpoint (reward model), or a fresh value head
# that has no HF counterpart (critic).
ROLES = ("actor", "reference", "critic", "reward")

_KINDS = ("replicated", "row", "vocab", "qkv", "gate_up")


@dataclasses.dataclass(frozen=True)
class ParamMap:
    """One megatron tensor and the HF tensors it is made of.

    `kind` names both how the HF tensors are combined and how the result is sliced over TP.
    `hf` lists HF names in combination order ((q, k, v) or (gate, up)); `layer` is the global
    layer index or None for embedding / final norm / head; `expert` is the global expert index
    of a routed expert's weight (held by one EP rank: `expert_range`), else None. `ffn` is the
    intermediate size of an MLP weight (dense, expert or shared expert; 0 for others), which
    sizes its TP slices.
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str
    layer: int | None = None
    expert: int | None = None
    ffn: int = 0

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"ParamMap {self.mcore}: unknown kind {self.kind!r}")


def layer_param_maps(arch: HFArch, layer: int, experts: Iterable[int] | None = None
                     ) -> list[ParamMap]:
    """The maps of one decoder layer (global index `layer`); of a MoE layer's routed experts
    only the global indices `experts` when given (one EP rank's: `expert_range`)."""
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    attn = h + "self_attn."
    maps = [
        ParamMap(m + "self_attention.linear_qkv.layer_norm_weight",
                 (h + "input_layernorm.weight",), "replicated", layer),
        ParamMap(m + "self_attention.linear_qkv.weight",
                 (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                 "qkv", layer),
    ]
    if arch.qkv_bias:
        maps.append(ParamMap(m + "self_attention.linear_qkv.bias",
                             (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                             "qkv", layer))
    if arch.qk_norm:
        # One RMSNorm weight [hd] shared by all heads, so every TP rank holds all of it.
        maps.append(ParamMap(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",),
                             "replicated", layer))
        maps.append(ParamMap(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",),
                             "replicated", layer))
    maps += [
        ParamMap(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row", layer),
        ParamMap(m + "mlp.linear_fc1.layer_norm_weight", (h + "post_attention_layernorm.weight",),
                 "replicated", layer),
    ]
    if arch.moe is not None and arch.moe.is_moe_layer(layer):
        return maps + moe_param_maps(arch, layer, experts)
    F = arch.ffn_hidden_size
    return maps + [
        ParamMap(m + "mlp.linear_fc1.weight",
                 (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gate_up", layer, ffn=F),
        ParamMap(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row", layer, ffn=F),
    ]


def moe_param_maps(arch: HFArch, layer: int, experts: Iterable[int] | None = None
                   ) -> list[ParamMap]:
    """The MLP maps of a MoE layer: router, the routed experts (all, or the global indices
    `experts`), and the shared expert with its gate where the family has one."""
    moe = arch.moe
    m, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}."
    mixtral = arch.model_type == "mixtral"
    block = h + ("block_sparse_moe." if mixtral else "mlp.")
    maps = [ParamMap(m + "router.weight", (block + "gate.weight",), "replicated", layer)]
    F = moe.ffn_hidden_size
    for e in range(moe.num_experts) if experts is None else experts:
        src = f"{block}experts.{e}."
        gate, up, down = (("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"))
        dst = f"{m}experts.local_experts.{e}."
        maps += [
            ParamMap(dst + "linear_fc1.weight", (f"{src}{gate}.weight", f"{src}{up}.weight"),
                     "gate_up", layer, e, F),
            ParamMap(dst + "linear_fc2.weight", (f"{src}{down}.weight",), "row", layer, e, F),
        ]
    if moe.shared_expert_ffn_hidden_size:
        S, src = moe.shared_expert_ffn_hidden_size, block + "shared_expert."
        maps += [
            ParamMap(m + "shared_experts.linear_fc1.weight",
                     (src + "gate_proj.weight", src + "up_proj.weight"), "gate_up", layer, ffn=S),
            ParamMap(m + "shared_experts.linear_fc2.weight", (src + "down_proj.weight",), "row",
                     layer, ffn=S),
        ]
        if moe.shared_expert_gate:
            maps.append(ParamMap(m + "shared_experts.gate_weight",
                                 (block + "shared_expert_gate.weight",), "replicated", layer))
    return maps


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """The global indices of the experts EP rank `ep_rank` of `ep_size` holds (megatron's
    contiguous split; its model numbers them 0.. locally)."""
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over expert parallel size {ep_size} "
                         "(expert_model_parallel_size must divide the number of experts)")
    n = num_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)


def head_param_map(arch: HFArch, role: str) -> ParamMap | None:
    """The output layer's map for a role; None when it has no HF source (critic, tied LM head)."""
    if role not in ROLES:
        raise ValueError(f"unknown model role {role!r}; expected one of {list(ROLES)}")
    if role in ("actor", "reference"):
        if arch.tie_embeddings:
            return None
        return ParamMap("output_layer.weight", ("lm_head.weight",), "vocab")
    if role == "reward":
        # The scalar head is tiny and the same on every TP rank.
        return ParamMap("output_layer.weight", ("score.weight",), "replicated")
    return None


def param_maps(arch: HFArch, role: str = "actor", layers: Sequence[int] | None = None,
               embedding: bool = True, head: bool = True,
               experts: Sequence[int] | None = None) -> list[ParamMap]:
    """All maps of a model (or of one pipeline stage: its `layers`, and embedding / final norm +
    head only on the first / last stage; of one EP rank: its routed `experts`)."""
    maps = []
    if embedding:
        maps.append(ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                             "vocab"))
    for layer in range(arch.num_layers) if layers is None else layers:
        maps += layer_param_maps(arch, layer, experts)
    if head:
        maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",),
                             "replicated"))
        out = head_param_map(arch, role)
        if out is not None:
            maps.append(out)
    return maps


def hf_shapes(arch: HFArch, role: str = "actor") -> dict[str, tuple[int, ...]]:
    """The shape config.json implies for every HF tensor `param_maps(arch, role)` reads."""
    H, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    by_suffix = {
        "layernorm.weight": (H,), "model.norm.weight": (H,),
        "q_proj.weight": (q, H), "k_proj.weight": (kv, H), "v_proj.weight": (kv, H),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "q_norm.weight": (hd,), "k_norm.weight": (hd,), "o_proj.weight": (H, q),
        "embed_tokens.weight": (arch.vocab_size, H), "lm_head.weight": (arch.vocab_size, H),
        "score.weight": (arch.num_labels or 0, H),
        "shared_expert_gate.weight": (1, H),
    }
    shapes = {}
    for pm in param_maps(arch, role):
        if pm.kind == "gate_up":  # MLP weights: their intermediate size is the map's
            shapes.update({name: (pm.ffn, H) for name in pm.hf})
        elif pm.ffn:
            shapes[pm.hf[0]] = (H, pm.ffn)
        elif pm.mcore.endswith(".mlp.router.weight"):
            shapes[pm.hf[0]] = (arch.moe.num_experts, H)
        else:
            for name in pm.hf:
                shapes[name] = next(shape for suffix, shape in by_suffix.items()
                                    if name.endswith(suffix))
    return shapes


# --------------------------------------------------------------------------------------------
# Names of GPTModel parameters <-> canonical names

_LOCAL_TO_CANONICAL = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")


def canonical_name(param_name: str, global_layer: int | None = None,
                   first_expert: int = 0) -> str:
    """Canonical name of a GPTModel parameter (local or TE spec); `global_layer` replaces the
    stage-local layer index when given (PP stages number their layers from 0), and a routed
    expert's local index is shifted by `first_expert` (the first global expert of this EP rank,
    `expert_range(...)[0]`) to its global index."""
    match = _LAYER_RE.match(param_name)
    if not match:
        return param_name
    index, rest = match.groups()
    rest = _LOCAL_TO_CANONICAL.get(rest, rest)
    expert = _LOCAL_EXPERT_RE.match(rest)
    if expert:
        rest = f"mlp.experts.local_experts.{int(expert.group(1)) + first_expert}.{expert.group(2)}"
    return f"decoder.layers.{index if global_layer is None else global_layer}.{rest}"


# --------------------------------------------------------------------------------------------
# Combining HF tensors into megatron tensors and back (full tensors, TP = 1)

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int) -> torch.Tensor:
    """q [nh*hd, ...], k/v [ng*hd, ...] -> megatron's group-interleaved [ng*(r+2)*hd, ...]."""
    rest = q.shape[1:]
    qg = q.reshape(num_groups, -1, *rest)  # [ng, r*hd, ...]
    kg = k.reshape(num_groups, -1, *rest)  # [ng, hd, ...]
    vg = v.reshape(num_groups, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv: [ng*(r+2)*hd, ...] -> q [nh*hd, ...], k, v [ng*hd, ...]."""
    rest = qkv.shape[1:]
    r = num_heads // num_groups
    grouped = qkv.reshape(num_groups, (r + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [r * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[n, ...] -> [rows, ...] with zero rows appended (vocabulary padding)."""
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        raise ValueError(f"pad_rows: tensor has {t.shape[0]} rows, more than {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def hf_to_mcore(pm: ParamMap, arch: HFArch, hf: Sequence[torch.Tensor],
                padded_vocab: int | None = None) -> torch.Tensor:
    """Full megatron tensor from the HF tensors named by `pm.hf` (in that order)."""
    if pm.kind == "qkv":
        return fuse_qkv(*hf, num_groups=arch.num_kv_heads)
    if pm.kind == "gate_up":
        return torch.cat(list(hf))
    if pm.kind == "vocab":
        return pad_rows(hf[0], padded_vocab or arch.padded_vocab_size())
    return hf[0]


def mcore_to_hf(pm: ParamMap, arch: HFArch, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF tensors (by name) from a full megatron tensor; vocabulary padding is dropped."""
    if pm.kind == "qkv":
        return dict(zip(pm.hf, split_qkv(full, arch.num_heads, arch.num_kv_heads, arch.head_dim)))
    if pm.kind == "gate_up":
        gate, up = torch.chunk(full, 2)
        return {pm.hf[0]: gate.contiguous(), pm.hf[1]: up.contiguous()}
    if pm.kind == "vocab":
        return {pm.hf[0]: full[: arch.vocab_size].contiguous()}
    return {pm.hf[0]: full}


def hf_tensors_from_mcore(arch: HFArch, full_params: Iterable[tuple[str, torch.Tensor]],
                          role: str = "actor") -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (HF name, tensor) from (canonical name, full TP=1 tensor) pairs, in any order.

    For weight export (rollout, converters): parameters without an HF counterpart (a critic's
    value head, the last stage's copy of a tied embedding) are skipped.
    """
    maps = {pm.mcore: pm for pm in param_maps(arch, role)}
    for name, full in full_params:
        pm = maps.get(name)
        if pm is not None:
            yield from mcore_to_hf(pm, arch, full).items()


# --------------------------------------------------------------------------------------------
# Tensor parallel slicing

def tp_slice(pm: ParamMap, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of a full megatron tensor."""
    if tp_size == 1 or pm.kind == "replicated":
        return full
    if pm.kind == "row":
        return torch.chunk(full, tp_size, dim=1)[tp_rank]
    if pm.kind == "gate_up":
        gate, up = torch.chunk(full, 2)
        return torch.cat([torch.chunk(gate, tp_size)[tp_rank], torch.chunk(up, tp_size)[tp_rank]])
    _check_divisible(pm, full.shape[0], tp_size)
    return torch.chunk(full, tp_size)[tp_rank]  # qkv (whole groups), vocab (padded rows)


def tp_merge(pm: ParamMap, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of tp_slice: the full tensor from the shards of TP ranks 0..T-1."""
    if len(shards) == 1 or pm.kind == "replicated":
        return shards[0]
    if pm.kind == "row":
        return torch.cat(list(shards), dim=1)
    if pm.kind == "gate_up":
        halves = [torch.chunk(s, 2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(list(shards))


def _check_divisible(pm: ParamMap, n: int, tp_size: int) -> None:
    if n % tp_size:
        raise ValueError(f"{pm.mcore}: dimension {n} does not divide by tensor parallel size "
                         f"{tp_size}")


def hf_read_slices(pm: ParamMap, arch: HFArch, tp_rank: int, tp_size: int,
                   padded_vocab: int | None = None) -> list[tuple[str, int, int, int]]:
    """Which part of each HF tensor TP rank `tp_rank` needs: (hf_name, dim, start, stop).

    Reading only these (safetensors `get_slice`) and passing them to `build_tp_local` gives the
    same tensor as `tp_slice(pm, hf_to_mcore(pm, ...), ...)` without materialising the whole.
    A vocabulary slice may stop short of the local size (the padding rows are not in HF).
    """
    if tp_size == 1 or pm.kind == "replicated":
        return [(name, 0, 0, -1) for name in pm.hf]
    if pm.kind == "qkv":
        _check_divisible(pm, arch.num_kv_heads, tp_size)
        groups = arch.num_kv_heads // tp_size
        g0, g1 = tp_rank * groups, (tp_rank + 1) * groups
        r = arch.num_heads // arch.num_kv_heads
        q_rows, kv_rows = r * arch.head_dim, arch.head_dim
        return [(pm.hf[0], 0, g0 * q_rows, g1 * q_rows), (pm.hf[1], 0, g0 * kv_rows, g1 * kv_rows),
                (pm.hf[2], 0, g0 * kv_rows, g1 * kv_rows)]
    if pm.kind == "gate_up":
        _check_divisible(pm, pm.ffn, tp_size)
        n = pm.ffn // tp_size
        return [(name, 0, tp_rank * n, (tp_rank + 1) * n) for name in pm.hf]
    if pm.kind == "row":
        # o_proj [H, nh*hd] and down_proj [H, F]: split their input features.
        cols = pm.ffn or arch.num_heads * arch.head_dim
        _check_divisible(pm, cols, tp_size)
        n = cols // tp_size
        return [(pm.hf[0], 1, tp_rank * n, (tp_rank + 1) * n)]
    if pm.kind == "vocab":
        padded = padded_vocab or arch.padded_vocab_size(tp_size)
        _check_divisible(pm, padded, tp_size)
        n = padded // tp_size
        start = tp_rank * n
        return [(pm.hf[0], 0, min(start, arch.vocab_size), min(start + n, arch.vocab_size))]
    raise ValueError(f"hf_read_slices: {pm.mcore} of kind {pm.kind!r} has no HF slice rule")


def build_tp_local(pm: ParamMap, arch: HFArch, parts: Sequence[torch.Tensor], tp_size: int,
                   padded_vocab: int | None = None) -> torch.Tensor:
    """This rank's megatron tensor from the HF parts read per `hf_read_slices`."""
    if pm.kind == "qkv":
        return fuse_qkv(*parts, num_groups=arch.num_kv_heads // tp_size)
    if pm.kind == "gate_up":
        return torch.cat(list(parts))
    if pm.kind == "vocab":
        padded = padded_vocab or arch.padded_vocab_size(tp_size)
        return pad_rows(parts[0], padded // tp_size)
    return parts[0]


# --------------------------------------------------------------------------------------------
# Pipeline stages

def stage_layers(num_layers: int, pp_size: int, pp_rank: int,
                 first_stage_layers: int | None = None,
                 last_stage_layers: int | None = None) -> range:
    """Global layer indices held by pipeline stage `pp_rank` (no virtual pipeline).

    Megatron's rule: the first / last stage hold `first_stage_layers` / `last_stage_layers`
    when set; the remaining layers are split evenly over the other stages.
    """
    if pp_size == 1:
        return range(num_layers)
    fixed = {0: first_stage_layers, pp_size - 1: last_stage_layers}
    middle_stages = [s for s in range(pp_size) if fixed.get(s) is None]
    middle_layers = num_layers - sum(n for n in fixed.values() if n is not None)
    if middle_stages:
        if middle_layers % len(middle_stages):
            raise ValueError(f"{middle_layers} layers do not split evenly over "
                             f"{len(middle_stages)} pipeline stages")
        per = middle_layers // len(middle_stages)
    elif middle_layers:
        raise ValueError(f"first + last stage layers leave {middle_layers} layers for no stage")
    else:
        per = 0
    sizes = [fixed[s] if fixed.get(s) is not None else per for s in range(pp_size)]
    start = sum(sizes[:pp_rank])
    return range(start, start + sizes[pp_rank])

