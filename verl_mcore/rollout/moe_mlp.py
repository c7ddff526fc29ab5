"""The native engine's mixture-of-experts MLP: router in fp32, top-k, the active experts' GEMMs
grouped, and the shared expert with its gate.

It reads the weights of a megatron MoELayer of the generation model (built at TP_g with every
expert local: EP_g = 1, each expert's fc1 / fc2 sliced over TP_g like a dense MLP) and computes
what that layer computes in training (megatron-core 0.16.1, `moe_router_dtype="fp32"`):

    logits = x @ W_router^T                          in fp32                 [T, E]
    pre-softmax (Qwen without norm_topk_prob):  p = softmax(logits); w, e = top-k(p)
    otherwise (Mixtral, Qwen with norm_topk_prob): l, e = top-k(logits); w = softmax(l)
    y_t = sum_j  fc2_e(( silu(gate_e x_t) * up_e x_t * w_tj ).to(dtype))   (e = e_tj)
    + shared expert(x_t) * sigmoid(x_t @ gate_weight^T)   (Qwen2-MoE)

megatron's SequentialMLP loops over the local experts with the token counts on the host, which
syncs and cannot be captured in a CUDA graph. Here the T*k (token, expert) pairs are sorted by
expert and both GEMMs run as one `torch._grouped_mm` each over the experts' stacked weights, with
the group offsets on the device: no host sync, so the decode step stays one CUDA graph. The
stacked weights are views, not copies: the generation model's parameters live in the
repartition's flat buffer (rollout/repartition.py), where one layer's experts are equally spaced
(fc1_0, fc2_0, fc1_1, fc2_1, ...), so fc1 of every expert is one strided view [E, 2F, H]. A model
whose experts are not laid out that way (loaded on its own) has them re-homed into one stacked
tensor per layer here. Where `torch._grouped_mm` refuses the weights (a torch without it, CUDA
in fp32, strides that are not multiples of 16 bytes), the experts run one GEMM each over their
sorted rows, with the counts read on the host: correct, not graph-capturable (the engine's graph
capture then falls back to eager decoding, as for any op that syncs).

The chosen experts of the last call's tokens are kept (`last_experts`, [T, k]); an engine that
records routing (NativeEngine(record_routing=True), routing replay's engine side) reads them after
each forward into its samples' `routed_experts` (models/router_replay.py says what the trainer does
with them).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F


def is_moe_layer(mlp: torch.nn.Module) -> bool:
    """A megatron MoELayer (router + experts), by its parts: TE and local specs alike."""
    return hasattr(mlp, "router") and hasattr(mlp, "experts")


class MoEDecodeMLP:
    """Callable like a megatron MLP: x [s, b, H] -> (y [s, b, H], None)."""

    def __init__(self, layer: torch.nn.Module, where: str = "MoE layer"):
        cfg = layer.config
        self.where = where
        _refuse_unsupported(cfg, layer, where)
        self.router_weight = layer.router.weight  # [E, H], replicated over TP_g
        self.num_experts, self.topk = cfg.num_moe_experts, cfg.moe_router_topk
        self.pre_softmax = bool(cfg.moe_router_pre_softmax)
        experts = list(layer.experts.local_experts)
        self.fc1 = [e.linear_fc1.weight for e in experts]  # [2F_local, H] each: [gate; up]
        self.fc2 = [e.linear_fc2.weight for e in experts]  # [H, F_local]
        self.w13 = stacked(self.fc1)  # [E, 2F_local, H]
        self.w2 = stacked(self.fc2)  # [E, H, F_local]
        self.shared = getattr(layer, "shared_experts", None)
        group = layer.experts.tp_group
        self.tp_group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.grouped = _grouped_mm_accepts(self.w13, self.w2)
        self.last_experts: Optional[torch.Tensor] = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, experts [T, k] int64), as megatron's router in fp32."""
        logits = F.linear(x.float(), self.router_weight.float())  # [T, E]
        if self.pre_softmax:
            return torch.topk(torch.softmax(logits, dim=-1), self.topk, dim=-1)
        top, experts = torch.topk(logits, self.topk, dim=-1)
        return torch.softmax(top, dim=-1), experts

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        self._check_views()
        s, b, h = x.shape
        x2 = x.reshape(s * b, h)
        weights, experts = self.route(x2)
        self.last_experts = experts
        out = self.routed(x2, weights, experts)
        if self.tp_group is not None:  # each rank holds its TP_g slice of every expert
            dist.all_reduce(out, group=self.tp_group)
        out = out.view(s, b, h)
        if self.shared is not None:  # its fc2 all-reduces over TP_g itself
            out = out + self.shared(x)
        return out, None

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed experts' output [T, H] (this rank's partial sum under TP_g) for x [T, H]."""
        t, k = experts.shape
        flat = experts.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        rows = x[order // k]  # [T*k, H]
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] group ends
        scale = weights.reshape(-1)[order].unsqueeze(-1)  # [T*k, 1] fp32
        if self.grouped:
            gate_up = torch._grouped_mm(rows, self.w13.transpose(1, 2), offs=offsets)
            act = (_swiglu(gate_up) * scale).to(x.dtype)  # megatron scales before fc2
            y = torch._grouped_mm(act, self.w2.transpose(1, 2), offs=offsets)  # [T*k, H]
        else:
            y = torch.empty_like(rows)
            start = 0
            for e, end in enumerate(offsets.tolist()):  # host sync: eager decoding only
                if end > start:
                    act = (_swiglu(rows[start:end] @ self.fc1[e].t()) * scale[start:end]).to(x.dtype)
                    y[start:end] = act @ self.fc2[e].t()
                start = end
        back = torch.empty_like(y)
        back[order] = y  # [T*k, H] in (token, slot) order: a fixed-order sum over the k slots
        return back.view(t, k, -1).float().sum(1).to(x.dtype)

    def _check_views(self) -> None:
        """The stacked views must still be the experts' storage: something that re-homes the
        parameters after the engine was built (a new flat buffer) would leave them stale."""
        if self.fc1[0].data_ptr() != self.w13.data_ptr() or \
                self.fc2[-1].data_ptr() != self.w2[-1].data_ptr():
            raise RuntimeError(f"native engine, {self.where}: the experts' weights moved after "
                               "the engine was built (their parameters were re-homed); build the "
                               "engine after the repartition's buffer")


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def stacked(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One [n, *shape] tensor over equally shaped parameters: a strided view of their common
    storage when they are equally spaced in it (the flat buffer), else a new stacked tensor that
    the parameters are re-homed into (their values kept)."""
    first = params[0]
    shape, dtype = first.shape, first.dtype
    if any(p.shape != shape or p.dtype != dtype or not p.is_contiguous() for p in params):
        raise ValueError(f"experts of different shapes or dtypes: {[tuple(p.shape) for p in params]}")
    n = len(params)
    if n == 1:
        return first.detach().unsqueeze(0)
    step = params[1].storage_offset() - first.storage_offset()
    same_storage = all(p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                       for p in params)
    if same_storage and step >= first.numel() and all(
            p.storage_offset() - first.storage_offset() == i * step for i, p in enumerate(params)):
        return first.detach().as_strided((n, *shape), (step, *first.stride()),
                                         first.storage_offset())
    stack = torch.stack([p.detach() for p in params])
    for i, p in enumerate(params):
        p.data = stack[i]
    return stack


def _grouped_mm_accepts(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs on these weights (dtype, device, strides): tried once, on
    one row per expert."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    e, _, h = w13.shape
    try:
        x = torch.zeros(e, h, dtype=w13.dtype, device=w13.device)
        offs = torch.arange(1, e + 1, dtype=torch.int32, device=w13.device)
        mid = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
        torch._grouped_mm(mid[:, : w2.shape[2]].contiguous(), w2.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    return True


def _refuse_unsupported(cfg, layer, where: str) -> None:
    """Router and expert settings this MLP does not compute, named (the families we build use
    none of them)."""
    bad = {
        "moe_router_score_function": cfg.moe_router_score_function != "softmax",
        "moe_router_enable_expert_bias": bool(getattr(cfg, "moe_router_enable_expert_bias", False)),
        "moe_router_num_groups": bool(getattr(cfg, "moe_router_num_groups", None)),
        "moe_router_topk_scaling_factor": getattr(cfg, "moe_router_topk_scaling_factor", None)
        not in (None, 1.0),
        "moe_expert_capacity_factor": getattr(cfg, "moe_expert_capacity_factor", None) is not None,
        "moe_apply_probs_on_input": bool(getattr(cfg, "moe_apply_probs_on_input", False)),
        "add_bias_linear": bool(cfg.add_bias_linear),
        "gated_linear_unit / activation": not (cfg.gated_linear_unit
                                               and cfg.activation_func is F.silu),
    }
    named = [k for k, v in bad.items() if v]
    if named:
        raise ValueError(f"native rollout engine, {where}: the MoE settings {named} are not "
                         "implemented by the engine's MoE MLP (rollout/moe_mlp.py)")
    ep = getattr(layer.experts, "ep_group", None)
    if ep is not None and dist.get_world_size(ep) > 1:
        raise ValueError(f"native rollout engine, {where}: the generation model has expert "
                         f"parallelism {dist.get_world_size(ep)}; it must hold every expert "
                         "(groups.gen: ep of one rank)")
