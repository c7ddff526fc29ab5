"""LoRA adapters on megatron-core's parallel linears, sharded like the layer they adapt.

    adapters = attach_lora(model, cfg.actor.lora, seed=cfg.trainer.seed)  # after the weights load
    with adapters_disabled(chunks): ...      # the base model (the reference log-probs)
    merged = adapter.merged(linear.weight)   # W + (alpha / r)·B·A, this rank's shard (generation)

Each targeted Hugging Face module is peft's LoRA: y = W·x + (alpha / r)·B·A·dropout(x), with its
own A [r, in] and B [out, r]. Megatron fuses HF modules (q/k/v in `linear_qkv`, gate/up in
`linear_fc1`), so one `LoRAAdapter` serves a fused layer and holds one (A, B) pair per targeted
part; a part left out adds nothing to its rows (q_proj alone adapts only the q rows).

Sharding, for TP rank t of T (the layer's own TP group):
- column-parallel (linear_qkv, linear_fc1): A [r, in] is replicated, B [out_part / T, r] holds
  this rank's rows of the part (whole KV groups for q/k/v, as the weight). x·Aᵀ is computed on
  every rank alike; its backward is all-reduced over TP (megatron's copy-to-TP region), so A's
  gradient is the full one on every rank. With sequence parallelism x arrives split along s and
  is gathered first, its backward only splitting the (already full) gradient.
- row-parallel (linear_proj, linear_fc2): A [r, in / T] holds this rank's columns, x·Aᵀ is a
  partial sum all-reduced over TP (reduce-scattered along s with sequence parallelism) before
  B [out, r], which is replicated. With sequence parallelism each rank sees its own tokens only,
  so B's gradient is partial: it is marked `sequence_parallel` and megatron's finalize_model_grads
  sums it over TP, as for the layer norms.
- the output layer (target "lm_head", outside "all-linear" as in peft; untied models only) is
  column-parallel over the vocabulary: B [V_padded / T, r] split, A [r, h] replicated; the
  padding rows export cut off and load as zeros.
Under PP each stage holds the adapters of its own layers (the last one, lm_head's). Everything
else is frozen: no gradients, no fp32 master copy, no optimizer state; DDP and the optimizer see
only A and B.

The adapter is a child of the layer's parent (`self_attention.lora_linear_qkv`, `mlp.lora_linear_fc1`),
not of the linear: the base weight keeps its name (loaders, the repartition and checkpoints find it
unchanged), and a forward hook on the linear adds the adapter's output. Initial values are drawn
from a generator seeded by (seed, layer, part) over the full tensor, then sliced: every layout
starts from the same adapters.

Hugging Face / peft names: `base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r], `base_model.model.lm_head.lora_A.weight` (`peft_key`).
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from verl_mcore.models.gpt import unwrap
from verl_mcore.models.lora_targets import (HEAD, HF_TARGETS, LINEARS, adapts_head, layer_targets,
                                            part_shapes, resolve_targets, tp_shard_dim)
from verl_mcore.models.weight_map import fuse_qkv

_HF_PARENT = {"self_attention": "self_attn", "mlp": "mlp"}


def hf_module(layer: Optional[int], target: str) -> str:
    """The Hugging Face causal LM's name of a targeted module (its weight: `<name>.weight`);
    lm_head has no layer."""
    if target == HEAD:
        return HEAD
    parent = _HF_PARENT[HF_TARGETS[target][0].split(".")[0]]
    return f"model.layers.{layer}.{parent}.{target}"


def peft_key(layer: Optional[int], target: str, which: str) -> str:
    """peft's name of an adapter tensor on a Hugging Face causal LM (`which`: "A" or "B")."""
    return f"base_model.model.{hf_module(layer, target)}.lora_{which}.weight"


def checkpoint_key(layer: Optional[int], target: str, which: str) -> str:
    """The adapter tensor's name in a dist checkpoint (LoRAAdapter.sharded_state_dict under its
    layer, or the model for lm_head; stored whole whatever the TP/PP: convert_hf's
    DistCheckpointReader.read takes it)."""
    if target == HEAD:
        return f"lora_output_layer.lora_{which}.{HEAD}"
    parent, child = HF_TARGETS[target][0].split(".")
    return f"decoder.layers.{layer}.{parent}.lora_{child}.lora_{which}.{target}"


def _generator(seed: int, layer: int, target: str, which: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(zlib.crc32(f"{seed}/{layer}/{target}/{which}".encode()))
    return g


def initial_values(arch, r: int, init, seed: int, layer: Optional[int], target: str,
                   vocab_rows: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Full fp32 A [r, in], B [out, r] as peft initialises them (`init`: True, "gaussian" or
    False), from a generator of their own: the same values at every layout (lm_head's padding
    rows, which differ with TP, come after the real ones)."""
    out, inp = part_shapes(arch, target, vocab_rows)
    a, b = torch.empty(r, inp), torch.zeros(out, r)
    if init == "gaussian":
        torch.nn.init.normal_(a, std=1.0 / r, generator=_generator(seed, layer, target, "A"))
    else:  # nn.Linear's default, as peft leaves lora_A
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=_generator(seed, layer, target, "A"))
    if init is False:  # peft's init_lora_weights=False: B keeps nn.Linear's default as well
        torch.nn.init.kaiming_uniform_(b, a=math.sqrt(5), generator=_generator(seed, layer, target, "B"))
    return a, b


def tp_slice(full: torch.Tensor, dim: Optional[int], tp_rank: int, tp_size: int) -> torch.Tensor:
    if dim is None or tp_size == 1:
        return full
    if full.shape[dim] % tp_size:
        raise ValueError(f"lora: a dimension of {full.shape[dim]} does not split over TP={tp_size}")
    return torch.chunk(full, tp_size, dim=dim)[tp_rank]


class LoRAAdapter(torch.nn.Module):
    """The adapters of one megatron linear (see the module docstring for the layout).

    lora_A[t] / lora_B[t] for each targeted part t; `scale` = alpha / r. `forward(x)` returns
    what the adapters add to the linear's output, in its layout ([s, b, out_local] for a
    column-parallel layer; [s(/TP), b, out] for a row-parallel one).
    """

    def __init__(self, linear: torch.nn.Module, linear_name: str, layer: Optional[int],
                 targets: Sequence[str], arch, *, r: int, alpha: float, dropout: float, init,
                 seed: int):
        super().__init__()
        parts, self.row_parallel = LINEARS[linear_name]
        self.linear_name, self.layer = linear_name, layer  # layer: None for the output layer
        self.parts = tuple(parts)
        self.targets = tuple(t for t in parts if t in targets)
        self.r, self.scale, self.dropout = r, alpha / r, dropout
        self.enabled = True
        self.tp_group = linear.tp_group
        self.tp_size, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.num_groups = arch.num_kv_heads // self.tp_size  # KV groups of this rank's qkv rows
        weight = linear.weight
        # The output layer's rows: the vocabulary as padded for this model (and TP).
        self.vocab_rows = weight.shape[0] * self.tp_size if linear_name == "output_layer" else None
        self.out_local = {t: part_shapes(arch, t, self.vocab_rows)[0]
                          // (1 if self.row_parallel else self.tp_size) for t in self.parts}
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for t in self.targets:
            a, b = initial_values(arch, r, init, seed, layer, t, self.vocab_rows)
            for which, full, store in (("A", a, self.lora_A), ("B", b, self.lora_B)):
                dim = tp_shard_dim(t, which)
                p = torch.nn.Parameter(tp_slice(full, dim, self.tp_rank, self.tp_size)
                                       .to(device=weight.device, dtype=weight.dtype).contiguous())
                # megatron's marks: a TP-split tensor counts once in the grad norm, a replicated
                # one only on TP rank 0; B of a row-parallel layer is summed over TP under SP.
                p.tensor_model_parallel = dim is not None and self.tp_size > 1
                p.partition_dim = dim if dim is not None else -1
                p.partition_stride = 1
                p.sequence_parallel = self.row_parallel and which == "B"
                store[t] = p

    # -------------------------------------------------------------------- math

    def _a(self) -> torch.Tensor:
        """[P*r, in(_local)]: the targeted parts' A stacked (one GEMM for all of them)."""
        return torch.cat([self.lora_A[t] for t in self.targets])

    def _b(self) -> torch.Tensor:
        """[out_local, P*r]: each part's B in its output rows and its own r columns, zeros
        elsewhere, in the linear's row order (group-interleaved q/k/v, [gate; up])."""
        width = self.r * len(self.targets)
        blocks = {}
        for t in self.parts:
            if t in self.targets:
                i = self.targets.index(t)
                b = self.lora_B[t]
                blocks[t] = F.pad(b, (i * self.r, width - (i + 1) * self.r))
            else:
                blocks[t] = self.lora_A[self.targets[0]].new_zeros(self.out_local[t], width)
        if self.linear_name == "self_attention.linear_qkv":
            return fuse_qkv(blocks["q_proj"], blocks["k_proj"], blocks["v_proj"], self.num_groups)
        return torch.cat([blocks[t] for t in self.parts])

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r)·B·A in this rank's shard of the linear's weight, fp32."""
        return (self._b().float() @ self._a().float()) * self.scale

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """W + (alpha / r)·B·A for this rank's shard `weight`: one new tensor of its shape and
        dtype (one GEMM accumulating onto W, rounded once); the base weight is not modified."""
        b, a = self._b().to(weight.dtype), self._a().to(weight.dtype)
        return torch.addmm(weight, b, a, alpha=self.scale)

    def forward(self, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        tp = self.tp_size > 1
        if self.row_parallel:
            x = F.dropout(x, self.dropout, self.training) if self.dropout else x
            h = x @ self._a().t()  # [s, b, r], a partial sum over this rank's input columns
            if tp:
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
                     if sequence_parallel else
                     mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        else:
            if tp and sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(
                    x, tensor_parallel_output_grad=False, group=self.tp_group)
            x = F.dropout(x, self.dropout, self.training) if self.dropout else x
            h = x @ self._a().t()  # [s, b, P*r], the same on every TP rank
            if tp:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        return (h @ self._b().t()) * self.scale

    # -------------------------------------------------------------------- checkpoints

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Dist-checkpoint entries: each tensor split along its TP dimension (tp_shard_dim),
        so a checkpoint resumes at any TP/PP."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axes = {}
        for t in self.targets:
            for which in ("A", "B"):
                dim = tp_shard_dim(t, which)
                if dim is not None:
                    axes[f"lora_{which}.{t}"] = dim
        return make_sharded_tensors_for_checkpoint(
            state, prefix, axes, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"))

    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy unsharded peft tensors {peft_key: tensor} of this layer into this rank's shards."""
        with torch.no_grad():
            for t in self.targets:
                for which, store in (("A", self.lora_A), ("B", self.lora_B)):
                    key = peft_key(self.layer, t, which)
                    if key not in tensors:
                        raise KeyError(f"lora: the adapter has no {key!r}")
                    full = tensors[key]
                    out, inp = part_shapes_of(self, t)
                    if t == HEAD and which == "B" and full.shape[0] < out:
                        # peft's lm_head has the HF vocabulary's rows; ours adds the padding.
                        full = F.pad(full, (0, 0, 0, out - full.shape[0]))
                    want = (self.r, inp) if which == "A" else (out, self.r)
                    if tuple(full.shape) != want:
                        raise ValueError(f"lora: {key} is {tuple(full.shape)}, this model's is {want}")
                    shard = tp_slice(full, tp_shard_dim(t, which), self.tp_rank, self.tp_size)
                    store[t].copy_(shard.to(store[t].dtype))


def part_shapes_of(adapter: LoRAAdapter, target: str) -> tuple[int, int]:
    """(out, in) of `target` unsharded, from the adapter's own tensors."""
    a, b = adapter.lora_A[target], adapter.lora_B[target]
    dim_a, dim_b = tp_shard_dim(target, "A"), tp_shard_dim(target, "B")
    inp = a.shape[1] * (adapter.tp_size if dim_a == 1 else 1)
    out = b.shape[0] * (adapter.tp_size if dim_b == 0 else 1)
    return out, inp


def _hook(adapter: LoRAAdapter):
    def add_adapter(linear, args, output):
        if not adapter.enabled:
            return output
        out, bias = output
        sp = bool(getattr(linear, "sequence_parallel", False))
        return out + adapter(args[0], sp).to(out.dtype), bias

    return add_adapter


def fold_frozen_dgrad() -> None:
    """Make megatron's frozen-weight linear compute its input gradient as one 2-D GEMM.

    LinearWithFrozenWeight.backward does `grad_output.matmul(weight)` on the 3-D [s, b, out]
    gradient. The output layer's arrives as the transpose of GPTModel's [b, s, V] logits
    (strides V, s·V, 1), which torch.matmul cannot fold into a matrix without a copy; with a
    weight that does not require grad it then broadcasts the weight and runs a batched GEMM of
    one row per token: 81% of a LoRA update of the 1.5B shape on the H200 (1.26 s per
    micro-batch of 16k tokens, against ~13 ms folded). Trainable weights fold (torch does so
    when the weight requires grad), so full-parameter training never met it. Size-1 dimensions
    merge without a copy, so the reshape is a view. Idempotent."""
    from megatron.core.tensor_parallel import layers

    cls = layers.LinearWithFrozenWeight
    if getattr(cls, "_verl_mcore_folded", False):
        return
    original = cls.backward

    def backward(ctx, grad_output):
        grads = original(ctx, grad_output.reshape(-1, grad_output.shape[-1]))
        return (grads[0].view(*grad_output.shape[:-1], grads[0].shape[-1]), *grads[1:])

    cls.backward = staticmethod(backward)
    cls._verl_mcore_folded = True


def attach_lora(model: torch.nn.Module, lora, arch, *, seed: int,
                trainable: Sequence[str] = ()) -> list[LoRAAdapter]:
    """Adapters on the targeted linears of one bare model chunk (its own layers), every other
    parameter frozen except the submodules named in `trainable` (a critic's value head,
    "output_layer", as peft's modules_to_save). Call after the base weights are loaded and
    before the precision wrapper (Float16Module casts the adapters with the model; the
    optimizer keeps their fp32 masters)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    fold_frozen_dgrad()
    targets = layer_targets(lora.target_modules)
    if lora.r < 1:
        raise ValueError(f"lora.r must be at least 1, got {lora.r}")

    model = unwrap(model)
    model.requires_grad_(False)
    for name in trainable:
        if hasattr(model, name):
            getattr(model, name).requires_grad_(True)
    adapters = []
    for layer_module in model.decoder.layers:
        layer = layer_module.layer_number - 1  # global index
        if not hasattr(layer_module.mlp, "linear_fc1"):
            raise ValueError("lora: mixture-of-experts layers are not supported (layer "
                             f"{layer} has no dense mlp.linear_fc1); set lora.enable=false")
        for linear_name, (parts, _) in LINEARS.items():
            mine = [t for t in parts if t in targets]
            if not mine:
                continue
            parent_name, child = linear_name.split(".")
            parent = getattr(layer_module, parent_name)
            linear = getattr(parent, child)
            if type(linear) not in (ColumnParallelLinear, RowParallelLinear):
                raise ValueError(
                    f"lora: layer {layer}'s {linear_name} is a {type(linear).__name__}; LoRA "
                    "adapts megatron's own ColumnParallelLinear / RowParallelLinear (the local "
                    "layer spec: build_gpt_model(use_te=False))")
            adapters.append(_adapt(parent, child, linear, linear_name, layer, mine, arch, lora, seed))
    if adapts_head(lora.target_modules) and getattr(model, "post_process", False):
        if "output_layer" in trainable:
            raise ValueError("lora.target_modules: lm_head on a model whose output layer trains "
                             "whole (a critic's value head); drop lm_head")
        if getattr(model, "share_embeddings_and_output_weights", False):
            raise ValueError("lora.target_modules: lm_head is tied to embed_tokens in this model "
                             "(tie_word_embeddings); an adapter on it would untie them in the "
                             "generation weights and the merged export. Drop lm_head")
        adapters.append(_adapt(model, "output_layer", model.output_layer, "output_layer", None,
                               [HEAD], arch, lora, seed))
    return adapters


def _adapt(parent, child, linear, linear_name, layer, targets, arch, lora, seed) -> LoRAAdapter:
    """A LoRAAdapter for `parent.<child>`, registered as `parent.lora_<child>` and added to the
    linear's output by a forward hook."""
    adapter = LoRAAdapter(linear, linear_name, layer, targets, arch, r=lora.r, alpha=lora.alpha,
                          dropout=lora.dropout, init=lora.init_lora_weights, seed=seed)
    parent.add_module(f"lora_{child}", adapter)
    linear.register_forward_hook(_hook(adapter))
    return adapter


def adapters_of(chunks: torch.nn.Module | Iterable[torch.nn.Module]) -> list[LoRAAdapter]:
    chunks = [chunks] if isinstance(chunks, torch.nn.Module) else list(chunks)
    return [m for c in chunks for m in c.modules() if isinstance(m, LoRAAdapter)]


@contextlib.contextmanager
def adapters_disabled(chunks) -> Iterator[None]:
    """The base model: every adapter of `chunks` adds nothing inside the block."""
    adapters = adapters_of(chunks)
    before = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, e in zip(adapters, before):
            a.enabled = e


def merged_weights(chunks) -> dict[str, LoRAAdapter]:
    """{global weight name (repartition.global_param_names' spelling): its adapter}."""
    out = {}
    for a in adapters_of(chunks):
        layer = "" if a.layer is None else f"decoder.layers.{a.layer}."
        out[f"{layer}{a.linear_name}.weight"] = a
    return out


def load_peft_dir(adapters: Sequence[LoRAAdapter], path: str, lora) -> None:
    """Start from a peft adapter directory (lora.init_from): its r, alpha and targets must be
    the config's; every adapter tensor of this rank's layers is read and sliced."""
    import json
    import os

    from safetensors import safe_open

    cfg_file = os.path.join(path, "adapter_config.json")
    weights = os.path.join(path, "adapter_model.safetensors")
    for f in (cfg_file, weights):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"lora.init_from={path!r}: no {os.path.basename(f)} there "
                                    "(a peft adapter directory has adapter_config.json and "
                                    "adapter_model.safetensors)")
    with open(cfg_file) as fh:
        meta = json.load(fh)
    # Variants of peft's LoRA whose math is not W + (alpha / r)·B·A: loaded as plain LoRA they
    # would give another model without a word.
    variants = [k for k in ("use_rslora", "use_dora") if meta.get(k)]
    variants += [k for k in ("rank_pattern", "alpha_pattern") if meta.get(k)]
    if variants:
        raise ValueError(f"lora.init_from={path!r}: its adapter_config.json sets {variants}; "
                         "only peft's plain LoRA (one r and alpha, no rsLoRA / DoRA) loads here")
    theirs = meta.get("target_modules") or []
    theirs = resolve_targets(theirs if isinstance(theirs, str) else sorted(theirs))
    mine = resolve_targets(lora.target_modules)
    if meta.get("r") != lora.r or float(meta.get("lora_alpha", -1)) != float(lora.alpha) or theirs != mine:
        raise ValueError(f"lora.init_from={path!r}: its r={meta.get('r')}, "
                         f"lora_alpha={meta.get('lora_alpha')}, target_modules={list(theirs)} differ "
                         f"from the config's r={lora.r}, alpha={lora.alpha}, "
                         f"target_modules={list(mine)}; set those to the adapter's")
    with safe_open(weights, framework="pt") as f:
        keys = set(f.keys())
        tensors = {}
        for a in adapters:
            for t in a.targets:
                for which in ("A", "B"):
                    key = peft_key(a.layer, t, which)
                    if key not in keys:
                        raise KeyError(f"lora.init_from={path!r}: adapter_model.safetensors has "
                                       f"no {key!r}")
                    tensors[key] = f.get_tensor(key)
    for a in adapters:
        a.load_full(tensors)


def peft_config(lora, base_model: str) -> dict:
    """adapter_config.json for peft.PeftModel.from_pretrained."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": list(resolve_targets(lora.target_modules)), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
        "init_lora_weights": True, "modules_to_save": None,
    }


def trainable_parameters(chunks) -> int:
    """Parameters that train on this rank (its shards of the adapters)."""
    chunks = [chunks] if isinstance(chunks, torch.nn.Module) else list(chunks)
    return sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
