"""In-place 3D repartition: training layout (TP_t × PP, VPP chunks) -> generation layout (TP_g, no PP).

For every parameter of the generation model, in one fixed order on all ranks:
  1. pipeline gather: the pipeline stage that owns the tensor broadcasts its TP_t shard inside the
     pipeline group, so every rank holds the TP_t shard of every layer;
  2. tensor re-slice: the k = TP_t / TP_g ranks of a micro-DP group all-gather their TP_t shards,
     which concatenate into this rank's TP_g shard (see distributed/groups.py for why). For the
     vocabulary this needs both models padded to the same size (`check_same_padded_vocab`).
The result is written straight into the generation model's parameters, which live in one flat
buffer per rank (allocated once, reused every step, releasable between phases). No rank ever holds
more than its TP_g shard plus one tensor in flight; nothing is staged through host memory.

Bytes received per rank: Σ over tensors of (what this rank lacks of its TP_g shard) — exactly
model/TP_g − model/(TP_t·PP) for a model with uniform stages, the minimum any scheme can do since
a rank starts with model/(TP_t·PP) and must end with model/TP_g.

With rollout.dtype=fp8 the generation model's linear weights are e4m3 views into an
`Fp8LinearWeights` store (rollout/fp8_weights.py) instead of the flat buffer: each one is
quantized as soon as it is assembled (`quantize_into`, a few thousand rows at a time), so no
full-precision copy of them exists beside the tensor in flight.

Mixture-of-experts models: the generation model holds every expert (EP_g = 1, each sliced over
TP_g like a dense MLP); a training rank holds its EP block of them. Each expert tensor is first
broadcast from its EP rank inside the owning stage's EP group, then goes through steps 1 and 2
like any tensor: a rank receives each tensor it lacks once, so the bound above holds with the
experts counted in (the bytes a rank lacks: the other EP ranks' experts too).

Layouts with TP_g = TP_t and PP = 1 need no copy: the training model serves generation as it is
(see `generation_model_is_training_model`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from verl_mcore.models.gpt import unwrap
from verl_mcore.models.hf_weights import expert_layout
from verl_mcore.models.weight_map import ParamMap, tp_merge

_LAYER = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)\.(.*)$")


def global_param_names(chunk: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters of one model chunk keyed by layout-independent names: global layer index, and
    a routed expert's global index (`mlp.experts.local_experts.<e>.`; an EP rank holds experts
    `expert_range(E, ep_rank, EP)` under local indices 0..)."""
    model = unwrap(chunk)
    first_expert = expert_layout(model)[0] if model.config.num_moe_experts else 0
    out = {}
    for name, param in model.named_parameters():
        m = _LAYER.match(name)
        if m:
            layer = model.decoder.layers[int(m.group(1))]
            rest = name[m.end():]
            e = _LOCAL_EXPERT.match(rest)
            if e:
                rest = f"{e.group(1)}{int(e.group(2)) + first_expert}.{e.group(3)}"
            name = f"decoder.layers.{layer.layer_number - 1}." + rest
        out[name] = param
    return out


def generation_model_is_training_model(tp_train: int, pp: int, tp_gen: int, vpp: Optional[int]) -> bool:
    return tp_train == tp_gen and pp == 1 and not (vpp and vpp > 1)


def check_same_padded_vocab(train_chunks: Iterable[torch.nn.Module], gen_model: torch.nn.Module) -> None:
    """Refuse, before any weight moves, a generation model whose padded vocabulary differs from
    the training model's: only equal sizes let TP_t vocabulary shards concatenate into TP_g ones
    (otherwise the copy fails on a shape mid-way, or a padding row lands on a real id)."""
    train = sorted({unwrap(c).vocab_size for c in train_chunks})
    gen = unwrap(gen_model).vocab_size
    if train != [gen]:
        raise ValueError(
            f"repartition: the generation model pads the vocabulary to {gen} rows, the training "
            f"model to {', '.join(map(str, train))}; they must be equal so that the training TP "
            "shards concatenate into the generation ones. Build the generation model with "
            "build_gpt_model(..., padded_vocab=<training model>.vocab_size) "
            "(verl_mcore.build.padded_vocab gives the run's size)")


def tensor_kind(name: str, gated_linear_unit: bool) -> str:
    """How a GPTModel tensor is split over TP (the kinds of models/weight_map.py). Read from the
    name: megatron only marks parameters as tensor-parallel when it initialises them."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if name.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")):
        return "qkv"
    # Dense MLPs, routed experts (sliced over expert TP = TP) and shared experts alike.
    if name.endswith(("self_attention.linear_proj.weight", "linear_fc2.weight")):
        return "row"
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return "gate_up" if gated_linear_unit else "qkv"  # qkv: contiguous rows
    return "replicated"


@dataclass
class RepartitionStats:
    bytes_received: int = 0
    bytes_sent: int = 0
    min_bytes_received: int = 0  # the lower bound for this rank and layout
    generation_bytes: int = 0  # size of this rank's TP_g shard (the flat buffer)
    peak_temp_bytes: int = 0  # largest temporary held at once beside the buffer
    seconds: float = 0.0
    per_tensor: list = field(default_factory=list, repr=False)


class FlatParameterBuffer:
    """Re-homes a module's parameters into one contiguous buffer (one allocation, reusable).

    `release()` frees the storage between generation phases (parameters keep their shapes but
    must not be read), `restore()` re-allocates it; the next repartition refills it. `exclude`:
    parameters whose storage lives elsewhere (an FP8 store's e4m3 weights).
    """

    def __init__(self, module: torch.nn.Module, exclude: Iterable[torch.nn.Parameter] = ()):
        skip = {id(p) for p in exclude}
        params = [p for p in module.parameters() if id(p) not in skip]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"generation model mixes parameter dtypes {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.device = params[0].device
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        offset = 0
        with torch.no_grad():
            for p in params:
                view = self.buffer[offset:offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                offset += p.numel()

    @property
    def nbytes(self) -> int:
        return self.numel * self.buffer.element_size()

    def release(self) -> None:
        self.buffer.untyped_storage().resize_(0)

    def restore(self) -> None:
        storage = self.buffer.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.numel * self.buffer.element_size())


def store_into(gen_param: torch.Tensor, full: torch.Tensor, fp8) -> int:
    """Write an assembled generation tensor into its place: copied into the parameter, or
    quantized into `fp8`'s slot for it (an Fp8LinearWeights or None). Returns the bytes of the
    temporaries the write took (the quantization's)."""
    if fp8 is None or fp8.slot_of(gen_param) is None:
        gen_param.copy_(full)
        return 0
    return fp8.quantize_into(gen_param, full)


@dataclass(frozen=True)
class _Entry:
    name: str
    owner_stage: int
    shape: tuple  # the TP_t shard's shape
    dtype: torch.dtype
    kind: str  # weight_map's TP kind: replicated, row, vocab, qkv, gate_up
    owner_ep: Optional[int] = None  # a routed expert's EP rank; None: every EP rank holds it


class Repartitioner:
    """Fills a generation-layout model from the training-layout chunks, on every rank at once.

    train_chunks: this rank's training model chunks (one per virtual pipeline stage), DDP-wrapped
        or bare. gen_model: the generation model built at TP_g with `groups.gen` process groups.
    gated_linear_unit: whether mlp.linear_fc1 holds [gate; up] per TP shard (SwiGLU models).
    """

    def __init__(self, train_chunks: Iterable[torch.nn.Module], gen_model: torch.nn.Module, groups,
                 gated_linear_unit: bool, merge: Optional[dict] = None, fp8=None):
        """merge: {global weight name: LoRAAdapter} (models/lora.merged_weights): those weights
        are sent as W + (alpha/r)·B·A, merged into one new tensor as each one's turn comes
        (the base weight is not modified). fp8: `Fp8LinearWeights.in_place(gen_model)`
        (rollout.dtype=fp8): the linear weights it holds are quantized into it."""
        train_chunks = list(train_chunks)
        self.merge = dict(merge or {})
        check_same_padded_vocab(train_chunks, gen_model)
        self.groups = groups
        self.layout = groups.layout
        self.gated = gated_linear_unit
        self.train_params: dict[str, torch.nn.Parameter] = {}
        for chunk in train_chunks:
            self.train_params.update(global_param_names(chunk))
        self.gen_params = global_param_names(gen_model)
        self.fp8 = fp8
        self.buffer = FlatParameterBuffer(gen_model, exclude=fp8.parameters() if fp8 else ())
        self.gen_params = global_param_names(gen_model)  # now views into the buffer
        self.rank = groups.rank  # global; the groups below are in global ranks
        coords = self.layout.coords(groups.index)  # coordinates inside the actor's set
        self.pp_ranks = next(g for g in self.layout.pp_groups() if self.rank in g)
        self.micro_ranks = next(g for g in self.layout.micro_dp_groups() if self.rank in g)
        self.pp_group = groups.train.pp
        self.micro_group = groups.micro_dp
        self.stage = coords["pp"]
        # Expert parallelism: each EP rank holds a block of every MoE layer's experts; the
        # generation model holds them all (EP_g = 1), so each expert is first broadcast from its
        # EP rank inside the owning stage's EP group.
        ep = getattr(groups.train, "ep", None)
        self.ep_group = ep if ep is not None and dist.get_world_size(ep) > 1 else None
        self.ep_ranks = dist.get_process_group_ranks(ep) if self.ep_group is not None else [self.rank]
        self.ep_rank = self.ep_ranks.index(self.rank)
        self.entries = self._catalog()

    def _catalog(self) -> list[_Entry]:
        """Agree, across the pipeline group (and the EP group), on who owns each generation
        tensor."""
        mine = {n: (tuple(p.shape), p.dtype, tensor_kind(n, self.gated))
                for n, p in self.train_params.items()}
        if tie := ("output_layer.weight" not in self.gen_params):
            mine.pop("output_layer.weight", None)  # the last stage's copy of a tied embedding
        all_stages: list = [None] * len(self.pp_ranks)
        dist.all_gather_object(all_stages, mine, group=self.pp_group)
        by_ep = [all_stages]  # [ep rank][stage] -> {name: (shape, dtype, kind)}
        if self.ep_group is not None:
            by_ep = [None] * len(self.ep_ranks)
            dist.all_gather_object(by_ep, all_stages, group=self.ep_group)
        entries = []
        for name in self.gen_params:
            owners = [(s, e) for e, stages in enumerate(by_ep) for s, held in enumerate(stages)
                      if name in held]
            if not owners:
                raise RuntimeError(f"repartition: no pipeline stage holds {name!r} "
                                   f"(tied embeddings: {tie})")
            stage, ep_rank = owners[0]
            everywhere = all(name in stages[stage] for stages in by_ep)
            entries.append(_Entry(name, stage, *by_ep[ep_rank][stage][name],
                                  owner_ep=None if everywhere else ep_rank))
        return entries

    @torch.no_grad()
    def run(self) -> RepartitionStats:
        import time

        start = time.perf_counter()
        self.buffer.restore()
        stats = RepartitionStats(generation_bytes=self.buffer.nbytes)
        if self.fp8 is not None:
            self.fp8.restore()
            stats.generation_bytes += self.fp8.nbytes
        k = len(self.micro_ranks)
        pp = len(self.pp_ranks)
        for entry in self.entries:
            gen_param = self.gen_params[entry.name]
            esize = torch.empty((), dtype=entry.dtype).element_size()
            shard_bytes = int(torch.Size(entry.shape).numel()) * esize
            # This rank's TP_t shard of the tensor is part of its TP_g shard whenever it holds it.
            at_stage = entry.owner_stage == self.stage
            own = at_stage and entry.owner_ep in (None, self.ep_rank)
            if own and entry.name in self.merge:
                shard = self.merge[entry.name].merged(self.train_params[entry.name].detach())
            elif own:
                shard = self.train_params[entry.name].detach().contiguous()
            else:
                shard = torch.empty(entry.shape, dtype=entry.dtype, device=gen_param.device)
            # 0. a routed expert: its EP rank broadcasts it inside the owning stage's EP group
            if entry.owner_ep is not None and at_stage:
                dist.broadcast(shard, src=self.ep_ranks[entry.owner_ep], group=self.ep_group)
                if own:
                    stats.bytes_sent += shard_bytes * (len(self.ep_ranks) - 1)
                else:
                    stats.bytes_received += shard_bytes
            # 1. pipeline gather: the owner stage broadcasts its TP_t shard
            if pp > 1:
                dist.broadcast(shard, src=self.pp_ranks[entry.owner_stage], group=self.pp_group)
                if at_stage:
                    stats.bytes_sent += shard_bytes * (pp - 1)
                else:
                    stats.bytes_received += shard_bytes
            temp = 0 if own and entry.name not in self.merge else shard_bytes
            # 2. tensor re-slice inside the micro-DP group
            if k > 1 and entry.kind != "replicated":
                parts = [torch.empty_like(shard) for _ in range(k)]
                dist.all_gather(parts, shard, group=self.micro_group)
                stats.bytes_received += shard_bytes * (k - 1)
                stats.bytes_sent += shard_bytes * (k - 1)
                full = tp_merge(ParamMap(entry.name, (), entry.kind), parts)
                temp += shard_bytes * k * 2
            else:
                full = shard
            if full.shape != gen_param.shape:
                raise RuntimeError(f"repartition: {entry.name}: assembled {tuple(full.shape)}, "
                                   f"generation model expects {tuple(gen_param.shape)}")
            temp += store_into(gen_param, full, self.fp8)
            stats.peak_temp_bytes = max(stats.peak_temp_bytes, temp)
            # The lower bound: what this rank lacked of its TP_g piece of this tensor.
            stats.min_bytes_received += gen_param.numel() * esize - (shard_bytes if own else 0)
        stats.seconds = time.perf_counter() - start
        return stats
