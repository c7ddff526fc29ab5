"""The FP8 generation copy of a GPTModel's linear layers (rollout.dtype=fp8).

Which weights: the four linear layers of every decoder layer -- linear_qkv, linear_proj,
linear_fc1, linear_fc2 -- which hold nearly all of a decode step's weight bytes (Qwen2.5-1.5B:
1.31 G of its 1.54 G parameters). They become e4m3 with one fp32 scale per output channel
(ops/fp8.py). The rest stays in the actor's compute dtype:
  * the embedding: a decode step reads one row per token, not the matrix;
  * the norms and biases: a few KB, and the norms set the scale of everything after them;
  * the LM head (the embedding itself when tied): its errors go straight into the log-probs
    that sampling, the weight-sync check and the off-policy corrections read, one logit per
    vocabulary entry with no later layer to average them out; it is 15% of the 1.5B model's
    bytes (tied: the embedding matrix, which must stay exact for its lookups anyway).

Two ways to hold them:
  * `Fp8LinearWeights.in_place(gen_model)`: the generation model is a copy of its own (a
    repartition or a cross-set transfer fills it). Its linear weights become views into one
    e4m3 buffer (their bf16 storage is freed: no full-precision copy stays), the scales live in
    one fp32 buffer, and the repartition quantizes each tensor as it arrives
    (`quantize_into`), one at a time.
  * `Fp8LinearWeights.copy_of(model)`: the training model serves generation (TP_g = TP_t,
    PP = 1). Its weights stay as they are (they are being trained); the e4m3 copy is a buffer
    of its own, quantized from them now and at every `refresh` (the engine's load_weights).

`forward(module, x)` is the FP8 version of megatron's ColumnParallelLinear /
RowParallelLinear forward for generation (no sequence parallelism: the engine turns it off):
the local GEMM by ops.fp8_linear, the all-reduce of a row-parallel output over the module's
TP group, and the bias as the module would add or return it (`skip_bias_add`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP

from verl_mcore.ops import fp8 as fp8_ops

# The linear layers of a decoder layer that go to FP8, as attribute paths from the layer.
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


@dataclass
class _Slot:
    name: str  # the layer-local path, e.g. "decoder.layers.3.mlp.linear_fc1"
    module: torch.nn.Module
    weight: torch.Tensor  # e4m3 [N, K], a view into the store's buffer
    scale: torch.Tensor  # fp32 [N]
    row_parallel: bool


def _linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every FP8 linear, refusing what `forward` does not reproduce."""
    out = []
    for i, layer in enumerate(model.decoder.layers):
        if type(layer.mlp) is not MLP:
            raise ValueError(f"rollout.dtype=fp8: decoder layer {i}'s MLP is a "
                             f"{type(layer.mlp).__name__} (MoE layers are not served in FP8); use "
                             "rollout.dtype=auto")
        for path in LINEARS:
            module = layer.get_submodule(path)
            kind = type(module)
            if kind not in (ColumnParallelLinear, RowParallelLinear):
                raise ValueError(
                    f"rollout.dtype=fp8: decoder layer {i}'s {path} is a {kind.__name__}; the FP8 "
                    "generation copy serves megatron's local linear layers (ColumnParallelLinear, "
                    "RowParallelLinear), not TransformerEngine's fused ones. Build without "
                    "TransformerEngine (uninstall it) or use rollout.dtype=auto")
            if kind is ColumnParallelLinear and module.gather_output:
                raise ValueError(f"rollout.dtype=fp8: decoder layer {i}'s {path} gathers its output")
            if kind is RowParallelLinear and not module.input_is_parallel:
                raise ValueError(f"rollout.dtype=fp8: decoder layer {i}'s {path} scatters its input")
            out.append((f"decoder.layers.{i}.{path}", module))
    return out


class Fp8LinearWeights:
    """E4m3 weights with per-output-channel scales for the linear layers of a GPTModel (module
    docstring). Build with `in_place` or `copy_of`."""

    def __init__(self, model: torch.nn.Module, in_place: bool):
        self.model = model
        self.in_place = in_place
        linears = _linears(model)
        shapes = [tuple(m.weight.shape) for _, m in linears]
        device = linears[0][1].weight.device
        self.numel = sum(n * k for n, k in shapes)
        self.rows = sum(n for n, _ in shapes)
        self.weights = torch.empty(self.numel, dtype=fp8_ops.FP8, device=device)
        self.scales = torch.empty(self.rows, dtype=torch.float32, device=device)
        self.slots: list[_Slot] = []
        self._by_module: dict[int, _Slot] = {}
        self._by_param: dict[int, _Slot] = {}
        at = row = 0
        for (name, module), (n, k) in zip(linears, shapes):
            slot = _Slot(name, module, self.weights[at:at + n * k].view(n, k),
                         self.scales[row:row + n], isinstance(module, RowParallelLinear))
            at, row = at + n * k, row + n
            self.slots.append(slot)
            self._by_module[id(module)] = slot
            if in_place:
                # The parameter becomes its e4m3 view (same shape: the repartition's catalog and
                # checks read shapes), and its bf16 storage goes; a megatron forward over it
                # fails on the dtype instead of computing with stale numbers.
                with torch.no_grad():
                    module.weight.data = slot.weight
                self._by_param[id(module.weight)] = slot

    @classmethod
    def in_place(cls, gen_model: torch.nn.Module) -> "Fp8LinearWeights":
        """The store of a generation model of its own: its linear weights become e4m3 views
        here, to be filled by the repartition (`quantize_into`)."""
        return cls(gen_model, in_place=True)

    @classmethod
    def copy_of(cls, model: torch.nn.Module) -> "Fp8LinearWeights":
        """An e4m3 copy of `model`'s linear weights (the training model serving generation),
        quantized now; `refresh` requantizes after the weights change."""
        store = cls(model, in_place=False)
        store.refresh()
        return store

    # ------------------------------------------------------------------ filling

    def parameters(self) -> list[torch.nn.Parameter]:
        """The model parameters whose storage this store holds (in_place), none for a copy."""
        return [s.module.weight for s in self.slots] if self.in_place else []

    def slot_of(self, param: torch.Tensor) -> Optional[_Slot]:
        """The slot of a generation-model parameter (in_place), None for a parameter kept in the
        compute dtype."""
        return self._by_param.get(id(param))

    @torch.no_grad()
    def quantize_into(self, param: torch.Tensor, full: torch.Tensor) -> int:
        """Write `full` (the assembled TP_g weight of `param`, in any float dtype) as e4m3 and
        scales into `param`'s slot; returns the bytes of the temporaries it took (fp32 rows and
        their e4m3 values, `fp8.QUANTIZE_ROWS` rows at a time)."""
        slot = self._by_param[id(param)]
        if tuple(full.shape) != tuple(slot.weight.shape):
            raise RuntimeError(f"fp8 generation weights: {slot.name}: assembled {tuple(full.shape)}, "
                               f"the slot holds {tuple(slot.weight.shape)}")
        fp8_ops.quantize_weight_into(full, slot.weight, slot.scale)
        return min(full.shape[0], fp8_ops.QUANTIZE_ROWS) * full.shape[1] * (4 + 1)

    @torch.no_grad()
    def refresh(self) -> None:
        """Requantize a copy from its model's current weights (one tensor at a time)."""
        if self.in_place:
            raise RuntimeError("Fp8LinearWeights.refresh: an in-place store is filled by the "
                               "repartition (quantize_into), not from its own model")
        self.restore()
        for slot in self.slots:
            fp8_ops.quantize_weight_into(slot.module.weight.detach(), slot.weight, slot.scale)

    # ------------------------------------------------------------------ memory

    @property
    def nbytes(self) -> int:
        return self.numel * self.weights.element_size() + self.rows * self.scales.element_size()

    def release(self) -> None:
        """Free the e4m3 weights and scales between generations (the views keep their shapes;
        `restore` and a refill bring them back)."""
        for t in (self.weights, self.scales):
            t.untyped_storage().resize_(0)

    def restore(self) -> None:
        for t in (self.weights, self.scales):
            storage = t.untyped_storage()
            if storage.size() == 0:
                storage.resize_(t.numel() * t.element_size())

    # ------------------------------------------------------------------ the forward

    def serves(self, module: torch.nn.Module) -> bool:
        return id(module) in self._by_module

    def forward(self, module: torch.nn.Module, x: torch.Tensor
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """megatron's parallel-linear forward for generation, `(output, bias)`, with this
        store's e4m3 weight of `module`: x [s, b, K_local] -> [s, b, N_local] (column parallel)
        or [s, b, N] all-reduced over the module's TP group (row parallel)."""
        slot = self._by_module[id(module)]
        out = fp8_ops.fp8_linear(x, slot.weight, slot.scale)
        if slot.row_parallel:
            group = module.tp_group
            if group is not None and group.size() > 1:
                out = reduce_from_tensor_model_parallel_region(out, group=group)
        bias = module.bias
        if bias is not None and not module.skip_bias_add:
            return out + bias, None
        return out, bias if module.skip_bias_add else None
