"""A tiny megatron-core GPTModel and a training loop for layout-parity tests on gloo ranks.

The model is Qwen2-shaped (RMSNorm, SwiGLU, RoPE, GQA, bias on QKV only) but small: 4 layers,
hidden 64, 4 query heads over 2 KV groups, vocab 128, sequences of 16 tokens, fp32.

Same weights on every layout: `reference_state_dict(seed)` builds the model once at TP=1, PP=1 with
megatron's own CPU initialisation and returns its full state dict; `load_sharded` copies each
rank's slice of it into a model built at any TP × PP. Slicing follows the rule megatron's CPU init
uses (`_initialize_affine_weight_cpu`: split the master weight along `partition_dim` into
`tp * partition_stride` chunks, rank r takes chunks r, r + tp, ...), and layer names are mapped
from local to global indices with each layer's `layer_number`.

All functions here expect megatron's parallel_state to be initialised by the caller and
`verl_mcore.distributed.cpu_compat.install()` to have run in this process.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterator

import torch
import torch.nn.functional as F

VOCAB = 128
SEQ = 16
NUM_LAYERS = 4
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
FFN = 128


def make_config(tp: int = 1, pp: int = 1, **overrides):
    """TransformerConfig of the tiny model for a TP × PP layout (fp32, no dropout)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        ffn_hidden_size=FFN,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=True,
        init_method_std=0.02,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model(config, tie_embeddings: bool = False, vp_stage: int | None = None):
    """GPTModel (local layer spec) holding this rank's pipeline stage (or virtual stage
    `vp_stage`) and tensor shard."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=tie_embeddings,
        position_embedding_type="rope",
        vp_stage=vp_stage,
    )


def reference_state_dict(seed: int, tie_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """Full (TP=1, PP=1) parameters from megatron's CPU init under `seed`.

    Needs model parallel state at TP=1, PP=1 while it runs (the caller re-initialises afterwards).
    """
    from megatron.core import parallel_state

    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_pipeline_model_parallel_world_size() == 1
    torch.manual_seed(seed)
    model = build_model(make_config(), tie_embeddings=tie_embeddings)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _global_name(model, local_name: str, tie_embeddings: bool) -> str:
    match = _LAYER.match(local_name)
    if match:
        layer = model.decoder.layers[int(match.group(1))]
        return f"decoder.layers.{layer.layer_number - 1}." + local_name[match.end():]
    if tie_embeddings and local_name == "output_layer.weight":
        # The last stage's copy of the tied embedding (PP > 1).
        return "embedding.word_embeddings.weight"
    return local_name


def tp_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of a full tensor, as megatron's CPU init would have made it."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, param.partition_stride
    chunks = torch.split(full, full.shape[dim] // (tp_size * stride), dim=dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=dim)


def load_sharded(model, full: dict[str, torch.Tensor], tie_embeddings: bool = False,
                 tp_group=None) -> None:
    """Copy this rank's slice of the full state dict into `model` (built at any TP × PP).
    tp_group: the model's TP group (default: parallel_state's)."""
    from megatron.core import parallel_state

    if tp_group is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
    else:
        tp_rank, tp_size = tp_group.rank(), tp_group.size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = _global_name(model, name, tie_embeddings)
            if key not in full:
                raise KeyError(f"tiny_gpt.load_sharded: no reference weight {key!r} for {name!r}")
            part = tp_slice(full[key], param, tp_rank, tp_size)
            if part.shape != param.shape:
                raise ValueError(
                    f"tiny_gpt.load_sharded: {name!r} (from {key!r}) has shape "
                    f"{tuple(param.shape)}, slice is {tuple(part.shape)}"
                )
            param.copy_(part)


def make_batches(seed: int, steps: int, global_batch: int) -> list[dict[str, torch.Tensor]]:
    """Random token batches, one per step: tokens/labels [global_batch, SEQ] int64."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return out


def _micro_batches(batch, dp_rank: int, dp_size: int, micro_batch: int) -> Iterator[dict]:
    """This DP rank's contiguous share of the global batch, cut into micro-batches."""
    per_rank = batch["tokens"].shape[0] // dp_size
    lo = dp_rank * per_rank
    for start in range(lo, lo + per_rank, micro_batch):
        yield {k: v[start:start + micro_batch] for k, v in batch.items()}


def _forward_step(data_iterator, model):
    mb = next(data_iterator)
    b, s = mb["tokens"].shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    # Causal mask comes from the attention's default (attention_mask=None).
    per_token = model(mb["tokens"], position_ids, None, labels=mb["labels"])  # [b, s]

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()  # mean over this micro-batch's b*s tokens
        # clone: the schedule divides the returned loss by num_microbatches in place.
        return loss, {"loss": loss.detach().clone()}

    return per_token, loss_func


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout; DP is what is left of the world size."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    overlap_p2p_comm: bool = False

    @property
    def p2p_overrides(self) -> dict:
        # overlap_p2p_comm needs batch_p2p_comm off (TransformerConfig checks it).
        if self.overlap_p2p_comm:
            return {"overlap_p2p_comm": True, "batch_p2p_comm": False}
        return {}

    def initialize(self) -> None:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
        )


def train(
    full_state: dict[str, torch.Tensor],
    batches: list[dict[str, torch.Tensor]],
    micro_batch: int,
    layout: Layout,
    tie_embeddings: bool = False,
    lr: float = 1e-3,
) -> dict[str, list[float]]:
    """Train the tiny model for len(batches) steps on `layout` (already initialised in
    parallel_state); return {"loss": [...], "grad_norm": [...]} per step, the same on every rank.

    Per step: every DP rank runs (global_batch / dp / micro_batch) micro-batches through
    megatron's forward_backward_func; the loss is the mean micro-batch loss averaged over DP ranks
    (equal-size micro-batches, so this is the global-batch token mean). The distributed optimizer
    (Adam, grad clip 1.0) then takes one step; grad_norm is its global norm before clipping.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = make_config(
        tp=layout.tp,
        pp=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        sequence_parallel=layout.sequence_parallel,
        **layout.p2p_overrides,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        model = build_model(
            config, tie_embeddings=tie_embeddings, vp_stage=vp_stage if layout.vpp else None
        )
        load_sharded(model, full_state, tie_embeddings=tie_embeddings)
        # As megatron's training loop does: only the first chunk uses bucketing.
        chunks.append(
            DistributedDataParallel(
                config=config, ddp_config=ddp_config, module=model, disable_bucketing=vp_stage > 0
            )
        )
    config.finalize_model_grads_func = finalize_model_grads  # DP grad reduce + tied-embedding sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=0.01, clip_grad=1.0,
            use_distributed_optimizer=True, params_dtype=torch.float32,
        ),
        chunks,
    )
    forward_backward = get_forward_backward_func()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    out: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for batch in batches:
        n_micro = batch["tokens"].shape[0] // (dp_size * micro_batch)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        # One iterator per model chunk, each over the same micro-batches (first chunk reads the
        # tokens, last chunk the labels), as the interleaved schedule expects.
        iterators = [_micro_batches(batch, dp_rank, dp_size, micro_batch) for _ in chunks]
        stored = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks,
            num_microbatches=n_micro,
            seq_length=SEQ,
            micro_batch_size=micro_batch,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        assert ok, "optimizer step reported failure (inf/nan grads?)"
        loss = torch.zeros(1, dtype=torch.float64)
        if parallel_state.is_pipeline_last_stage():
            loss += torch.stack([d["loss"] for d in stored]).double().mean()
            torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss /= dp_size
        # Every rank returns the same numbers: sum over the pipeline group (zeros elsewhere).
        torch.distributed.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
        out["loss"].append(loss.item())
        out["grad_norm"].append(float(grad_norm))
    return out
