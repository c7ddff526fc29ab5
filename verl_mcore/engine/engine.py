"""The megatron-core training engine of one role (actor, critic or reference).

    engine = MegatronEngine(model_provider, transformer_config, pg_collection,
                            dtype="bf16", optim=cfg.actor.optim, lr_decay_steps=total_steps)
    mbs = engine.micro_batches(batch, max_tokens=4096)            # this rank's share, balanced
    engine.zero_grad()
    per_mb = engine.forward_backward(mbs, loss_fn, forward_only=False)
    stats = engine.optimizer_step()                               # {"grad_norm", "lr", ...}
    metrics = engine.reduce_metrics(per_mb)                       # same dict on every rank

What it holds (plain attributes, also used by checkpoint.py and offload.py):
    .model       list of model chunks, one per virtual pipeline stage; each a megatron-core
                 DistributedDataParallel (fp32 grad buffers, fp32 grad reduction) around the module
                 (Float16Module(GPTModel) for bf16/fp16, the GPTModel itself for fp32). A
                 forward-only engine (optim=None) holds the bare modules, in eval mode, no grads.
    .optimizer   megatron-core optimizer (Adam; distributed optimizer when asked; fp16 gets
                 dynamic loss scaling) or None
    .scheduler   OptimizerParamScheduler (constant / linear / cosine decay after linear warmup)
    .config      the role's TransformerConfig (precision and recompute applied)

Loss convention of `forward_backward`: `loss_fn(output, micro_batch) -> (loss, metrics)` returns
this micro-batch's CONTRIBUTION: the quantity to minimise is the plain sum of contributions over
all micro-batches of all DP ranks (verl_mcore.algo.aggregation builds exactly these with global
denominators). Megatron's schedule divides each micro-batch loss by the number of micro-batches
and DDP averages gradients over the DP group, so the engine multiplies every contribution by
(num_microbatches x dp_size) before handing it over; the gradient is then exactly the gradient
of the sum, independent of how the batch was split. `metrics` values are 0-dim tensors that sum
the same way; `reduce_metrics` sums them over micro-batches and DP ranks.

One `forward_backward` serves every layout: no pipeline, 1F1B (PP), interleaved (PP x VPP); TP
and DP come with the model and DDP. With PP, micro-batches are padded to one shape per call (p2p
buffers have a fixed shape). Context parallelism is
not supported yet (the engine refuses CP > 1).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from verl_mcore.engine import optim_step
from verl_mcore.engine.batch import TrainBatch
from verl_mcore.engine.moe_metrics import RoutingMetrics
from verl_mcore.engine.packing import (MicroBatch, build_micro_batch, pad_micro_batch,
                                       plan_micro_batches)
from verl_mcore.models import grad_accum
from verl_mcore.models.router_replay import ForcedRouting
from verl_mcore.utils.device import compute_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# An optimizer step that changes the norm of the weights it updates by more than this factor (up
# or down) has diverged: Adam moves each weight by about lr per step, a tiny fraction of any
# trained or initialised weight, so a real step changes the norm by far less than 1%.
MAX_PARAM_NORM_CHANGE = 2.0


class DivergedStepError(RuntimeError):
    """An optimizer step left the weights non-finite or changed their norm beyond
    MAX_PARAM_NORM_CHANGE; raised on every rank alike (the norm is globally reduced). The
    weights are already written: the run must stop without saving them."""

# A loss function: (last-stage model output, micro-batch) -> (contribution, {name: 0-dim tensor})
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[Optional[torch.Tensor], dict]]
# A model provider: (config, pre_process, post_process, vp_stage) -> module (e.g. a GPTModel)
ModelProvider = Callable[..., torch.nn.Module]


def role_config(config, dtype: str, recompute_activations: bool = False,
                grad_accum_fusion: bool = False):
    """Copy of a TransformerConfig with a role's precision and activation recompute applied.

    dtype "bf16"/"fp16": half-precision parameters and activations (fp32 master weights live in the
    optimizer); "fp32": everything fp32. Recompute: full, one layer at a time ("uniform", 1), the
    largest saving; megatron re-runs each layer's forward during backward. grad_accum_fusion:
    megatron's gradient_accumulation_fusion (needs DDP's main_grad and models/grad_accum.install).
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} for a role; choose one of {list(DTYPES)}")
    if config.context_parallel_size != 1:
        raise ValueError(
            f"context_parallel_size={config.context_parallel_size}: the engine does not support "
            "context parallelism yet; set parallel.context_parallel_size=1"
        )
    torch_dtype = DTYPES[dtype]
    changes = dict(
        fp16=dtype == "fp16", bf16=dtype == "bf16", params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype, variable_seq_lengths=False,
        gradient_accumulation_fusion=grad_accum_fusion,
    )
    if config.pipeline_model_parallel_size == 2 and (config.virtual_pipeline_model_parallel_size or 1) > 1:
        # With two stages both pipeline neighbours are the same rank, and the batched p2p path
        # posts [send_prev, recv_prev, send_next, recv_next] on both sides, pairing a gradient
        # with an activation (seen on gloo: wrong gradients from the second step on). The
        # unbatched path orders even/odd ranks and splits the two directions over two groups.
        changes["batch_p2p_comm"] = False
    if recompute_activations:
        changes.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    else:
        changes.update(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    return dataclasses.replace(config, **changes)


class MegatronEngine:
    """Model chunks + DDP + optimizer + LR schedule of one role, and its forward/backward."""

    def __init__(
        self,
        model_provider: ModelProvider,
        config,
        pg_collection,
        *,
        dtype: str = "bf16",
        optim=None,
        recompute_activations: bool = False,
        lr_decay_steps: int = 1,
        use_distributed_optimizer: bool = True,
        load_weights: Optional[Callable[[torch.nn.Module], None]] = None,
        vocab_size: Optional[int] = None,
        grad_accum_fusion: bool = True,
        router_replay: bool = False,
    ):
        """
        model_provider(config, pre_process, post_process, vp_stage) builds one model chunk.
        config: the model's TransformerConfig (its TP/PP/VPP sizes must match pg_collection).
        pg_collection: megatron ProcessGroupCollection of the training layout (ParallelGroups.train).
        optim: an OptimConfig (verl_mcore.config.schema) or None for a forward-only role.
        lr_decay_steps: optimizer steps over which cosine/linear decay runs (total PPO updates).
        load_weights(module): optional, called on each bare chunk before wrapping (tests, HF loads).
        vocab_size: the real vocabulary size; log-probs give padded ids no mass (None: no padding).
        grad_accum_fusion: a trainable engine's parallel linears add their weight gradients
            straight into DDP's fp32 main_grad in the backward GEMM (megatron's
            gradient_accumulation_fusion, with models/grad_accum.py standing in for apex)
            instead of returning a bf16 gradient that DDP then adds. Off only to compare.
        router_replay: a MoE model's routers take the experts of each micro-batch's `routing`
            (the rollout engine's, models/router_replay.py) in every forward; the gates are
            recomputed from this model's router, which keeps its gradients.
        """
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.transformer.module import Float16Module

        self.pg = pg_collection
        self._p2p = None  # the pipeline schedule's communicator, made on first use
        self.vocab_size = vocab_size
        self.skip_nonfinite = False  # trainer.on_nonfinite=skip sets it (see optimizer_step)
        self.param_norm: Optional[float] = None  # of the weights the optimizer updates, last step
        self.dtype = dtype
        self.trainable = optim is not None
        # Only where DDP gives every parameter a main_grad: megatron's fused backward writes there.
        fusion = grad_accum_fusion and self.trainable
        if fusion:
            grad_accum.install()
        self.config = role_config(config, dtype, recompute_activations, grad_accum_fusion=fusion)
        self.tp_size = self.pg.tp.size()
        self.pp_size = self.pg.pp.size()
        self.pp_rank = self.pg.pp.rank()
        self.dp_size = self.pg.dp.size()
        self.vpp_size = self.config.virtual_pipeline_model_parallel_size or 1
        if self.tp_size != self.config.tensor_model_parallel_size or self.pp_size != self.config.pipeline_model_parallel_size:
            raise ValueError(
                f"TransformerConfig has TP={self.config.tensor_model_parallel_size}, "
                f"PP={self.config.pipeline_model_parallel_size} but the process groups have "
                f"TP={self.tp_size}, PP={self.pp_size}"
            )

        chunks = []
        for vp in range(self.vpp_size):
            pre = self.pp_rank == 0 and vp == 0
            post = self.pp_rank == self.pp_size - 1 and vp == self.vpp_size - 1
            module = model_provider(self.config, pre, post, vp if self.vpp_size > 1 else None)
            if load_weights is not None:
                load_weights(module)
            if dtype != "fp32":
                module = Float16Module(self.config, module)
            chunks.append(module)
        if router_replay and recompute_activations:
            # the recomputed forward would run after the next micro-batch set its targets
            raise ValueError("routing replay with activation recompute: set "
                             "actor.recompute_activations=false or actor.router_replay=off")
        self.replay = ForcedRouting(chunks) if router_replay else None

        self.optimizer = None
        self.scheduler = None
        self.routing: Optional[RoutingMetrics] = None  # a trainable MoE model's (below)
        self._routed_micro_batches = 0
        if not self.trainable:
            for m in chunks:
                m.eval()
                m.requires_grad_(False)
            self.model = chunks
            return

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=use_distributed_optimizer,
        )
        # As megatron's own training loop: only the first chunk buckets its grads.
        self.model = [
            DistributedDataParallel(
                config=self.config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0,
                pg_collection=self.pg,
            )
            for i, m in enumerate(chunks)
        ]
        # A MoE model's load-balancing loss and tokens per expert, per optimizer step.
        if self.config.num_moe_experts:
            self.routing = RoutingMetrics(chunks, self.pg, self.config.num_layers)
        self.optimizer = _build_optimizer(optim, self.model, dtype, use_distributed_optimizer,
                                          self.pg)
        self.scheduler = _build_scheduler(optim, self.optimizer, lr_decay_steps)
        # Hooks megatron's schedule calls: DP grad reduction (and tied-embedding sync) after the
        # last backward, and the fp16 loss scale before each backward. Every group from the
        # role's own collection (the schedule passes it too): the default would read
        # parallel_state, which a role set of its own does not initialise.
        self.config.finalize_model_grads_func = functools.partial(finalize_model_grads,
                                                                  pg_collection=self.pg)
        self.config.grad_scale_func = self.optimizer.scale_loss
        no_sync = [m.no_sync for m in self.model]
        self.config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]

    # ------------------------------------------------------------------ micro-batches

    @property
    def pad_multiple(self) -> int:
        """Each packed sequence is padded to this (TP; sequence parallel splits tokens over TP)."""
        return self.tp_size

    def micro_batches(
        self, batch: TrainBatch, *, max_tokens: Optional[int] = None, micro_batch_size: Optional[int] = None
    ) -> list[MicroBatch]:
        """This DP rank's micro-batches of `batch` (the global batch, same on all ranks).

        max_tokens: packed THD micro-batches with at most this many tokens (padding included),
        balanced across DP ranks and micro-batches; micro_batch_size: padded micro-batches of that
        many samples. The count is equal on all DP ranks (and a multiple of PP under VPP).
        """
        # Micro-batches are laid out on the host; fields computed on the GPU (old log-probs,
        # advantages) come over once here, not once per micro-batch.
        batch = batch.cpu()
        if self.replay is None and batch.routed_experts is not None:  # nothing here replays it
            batch = dataclasses.replace(batch, routed_experts=None)
        plan = plan_micro_batches(
            batch.seq_lens.tolist(), self.dp_size, max_tokens=max_tokens,
            micro_batch_size=micro_batch_size, pad_multiple=self.pad_multiple,
            count_multiple=self.pp_size if self.vpp_size > 1 else 1,
        )
        rows = plan[self.pg.dp.rank()]
        return [build_micro_batch(batch, r, packed=max_tokens is not None, pad_multiple=self.pad_multiple) for r in rows]

    # ------------------------------------------------------------------ forward / backward

    def zero_grad(self) -> None:
        for m in self.model:
            if hasattr(m, "zero_grad_buffer"):
                m.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn, forward_only: bool) -> list[dict]:
        """Run `micro_batches` through megatron's pipeline schedule (see module docstring).

        Returns the `metrics` dicts of loss_fn, one per micro-batch, on the last pipeline stage;
        an empty list on the other stages. With forward_only=False the gradients are accumulated
        into the DDP buffers (and reduced over DP) but the optimizer is not stepped.
        """
        if not forward_only and not self.trainable:
            raise RuntimeError("forward_backward(forward_only=False) on a forward-only engine (no optimizer)")
        n_micro = len(micro_batches)
        device = training_device()
        scale = float(n_micro * self.dp_size)
        half = self.dtype != "fp32"

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            kwargs = {"fp32_output": False} if half else {}
            if self.replay is not None:  # this micro-batch's routing (None: the routers' own)
                self.replay.force(mb.routing)
            output = model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params, **kwargs)

            def loss_func(output_tensor):
                loss, metrics = loss_fn(output_tensor, mb)
                if loss is None:
                    loss = output_tensor.new_zeros((), dtype=torch.float32)
                elif not forward_only and not loss.requires_grad:
                    # An empty micro-batch (padding only) still needs a graph for the backward.
                    loss = loss + 0.0 * output_tensor.float().sum()
                return loss * scale, metrics

            return output, loss_func

        # Pipeline p2p buffers have one shape per schedule call, so with PP every micro-batch is
        # grown to the largest (balanced partitioning keeps the extra padding small). Megatron's
        # alternative, variable_seq_lengths, exchanges shapes in an order that mismatches
        # send/recv pairs when PP=2 with virtual stages (both neighbours are the same rank).
        rows = max(mb.input_ids.shape[0] for mb in micro_batches)
        seq = max(mb.input_ids.shape[1] for mb in micro_batches)
        if self.pp_size > 1:
            micro_batches = [pad_micro_batch(mb, (rows, seq)) for mb in micro_batches]
        if self.routing is not None and not forward_only:
            self.routing.begin()
            self._routed_micro_batches = n_micro
        # One iterator per chunk over the same micro-batches, as the interleaved schedule expects.
        on_device = [mb.to(device) for mb in micro_batches]
        iterators = [iter(on_device) for _ in self.model]
        for m in self.model:
            m.train(not forward_only)
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            out = self._schedule()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=self.model,
                num_microbatches=n_micro,
                seq_length=seq,  # p2p activations are [seq, rows, hidden] ([T, 1, hidden] packed)
                micro_batch_size=rows,
                forward_only=forward_only,
                **self._schedule_groups(),
            )
        return list(out) if self.is_last_stage else []

    def replay_mismatch(self) -> tuple[int, int]:
        """Routing replay's counts since the last call: (token-layers where the router's own
        experts differed from the replayed ones, token-layers replayed), summed over this role's
        ranks (collective over PP, each stage counting its layers, and DP, each rank its tokens;
        TP ranks route the same tokens). (0, 0) without routing replay."""
        if self.replay is None:
            return 0, 0
        counts = torch.tensor(self.replay.mismatch(reset=True), dtype=torch.int64,
                              device=compute_device())
        for group in (self.pg.pp, self.pg.dp):
            if group.size() > 1:
                dist.all_reduce(counts, group=group)
        return int(counts[0]), int(counts[1])

    def moe_metrics(self) -> dict[str, float]:
        """The last training pass's routing metrics (engine/moe_metrics.py; {} for a dense
        model). Collective over PP and DP."""
        if self.routing is None or not self._routed_micro_batches:
            return {}
        return self.routing.take(self._routed_micro_batches)

    def _schedule(self):
        """megatron's schedule for this engine's layout (not parallel_state's, which a role set
        of its own leaves uninitialised): no pipeline, 1F1B, or interleaved."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func(pp_size=self.pp_size,
                                         vp_size=self.vpp_size if self.vpp_size > 1 else None)

    def _schedule_groups(self) -> dict:
        """The schedule's process groups: the role's collection, and with PP a p2p communicator
        over its pipeline group (megatron takes both or neither)."""
        if self.pp_size == 1:
            return {"pg_collection": self.pg}
        if self._p2p is None:
            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

            self._p2p = P2PCommunicator(pp_group=self.pg.pp, config=self.config)
        return {"pg_collection": self.pg, "p2p_communicator": self._p2p}

    def optimizer_step(self) -> dict[str, float]:
        """Step the optimizer and (when the step was taken) the LR schedule.

        Returns {"grad_norm": global norm before clipping, "lr": the LR this step used,
        "skipped": 1.0 when the step was not taken, "skipped_nonfinite": 1.0 when it was skipped
        for a non-finite gradient norm, "param_norm": norm of the updated weights after the
        step}. A step is skipped when fp16 loss scaling finds inf/nan, and, with
        `skip_nonfinite` set (trainer.on_nonfinite=skip), whenever the global gradient norm is
        not finite: megatron's clipping would otherwise scale every gradient by nan and write nan
        into every weight. The norms are reduced over all model- and data-parallel ranks, so
        every rank takes the same decisions.

        Raises DivergedStepError when a taken step leaves the weights non-finite or changes
        their norm by more than MAX_PARAM_NORM_CHANGE (finite loss and gradient norm do not
        exclude that: at lr=1e30 the weights went to 1e30 and were saved as a good step).
        """
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.param_norm is None:  # the first step of this process: the norm it starts from
            self.param_norm = float(optim_step.global_param_norm(self.optimizer))
        ok, grad_norm = self._step()
        if ok:
            self.scheduler.step(increment=1)
            self._check_param_norm(lr, grad_norm)
        nonfinite = grad_norm is not None and not math.isfinite(grad_norm)
        out = {"grad_norm": float(grad_norm) if grad_norm is not None else math.nan, "lr": lr,
               "skipped": 0.0 if ok else 1.0, "skipped_nonfinite": 1.0 if not ok and nonfinite else 0.0,
               "param_norm": self.param_norm}
        if self.dtype == "fp16":
            out["loss_scale"] = float(self.optimizer.get_loss_scale())
        return out

    def _check_param_norm(self, lr: float, grad_norm: Optional[float]) -> None:
        before = self.param_norm
        after = float(optim_step.global_param_norm(self.optimizer))
        self.param_norm = after
        if math.isfinite(after) and (
                before == 0 or before / MAX_PARAM_NORM_CHANGE <= after <= before * MAX_PARAM_NORM_CHANGE):
            return
        what = ("made the weights non-finite" if not math.isfinite(after) else
                f"changed the norm of the weights from {before:.4g} to {after:.4g}")
        raise DivergedStepError(
            f"the optimizer step {what} (lr {lr:.3g}, gradient norm before clipping "
            f"{grad_norm:.4g}); the weights of this step are not saved. Lower the learning "
            f"rate or raise the clipping (optim.clip_grad), or check the data and rewards")

    @torch.no_grad()
    def _step(self) -> tuple[bool, Optional[float]]:
        """megatron's MegatronOptimizer.step (prepare, norm, clip, step), with the norm computed
        once and without a host sync per parameter (optim_step.py), and, when `skip_nonfinite`
        is set, a finiteness check of that norm before anything is written."""
        if self.optimizer.prepare_grads():  # fp16 loss scaler found inf/nan
            return False, None
        grad_norm = float(optim_step.global_grad_norm(self.optimizer))
        if self.skip_nonfinite and not math.isfinite(grad_norm):
            self.zero_grad()
            return False, grad_norm
        clip = self.optimizer.config.clip_grad
        if clip > 0.0:
            optim_step.clip_by_total_norm(self.optimizer, clip, grad_norm)
        return bool(self.optimizer.step_with_ready_grads()), grad_norm

    # ------------------------------------------------------------------ reductions

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def reduce_metrics(self, per_micro_batch: list[dict]) -> dict[str, float]:
        """Sum metric contributions over micro-batches and DP ranks; the same dict on every rank.

        Collective over the DP group (last stage) and the PP group.
        """
        result = None
        if self.is_last_stage:
            keys = sorted({k for d in per_micro_batch for k in d})
            sums = torch.zeros(len(keys), dtype=torch.float64, device=training_device())
            for d in per_micro_batch:
                for i, k in enumerate(keys):
                    if k in d:
                        sums[i] += d[k].detach().to(torch.float64).reshape(())
            if self.dp_size > 1:
                dist.all_reduce(sums, group=self.pg.dp)
            result = dict(zip(keys, sums.tolist()))
        if self.pp_size > 1:
            box = [result]
            dist.broadcast_object_list(box, group=self.pg.pp, group_src=self.pp_size - 1)
            result = box[0]
        return result

    def gather_rows(self, parts: list[tuple[torch.Tensor, torch.Tensor]], num_rows: int, width: int) -> torch.Tensor:
        """Per-micro-batch results `(rows [n], values [n, R])` of this rank -> `[num_rows, R]`
        float32 in batch order, the same on every rank (sum over DP, then over PP: each row is
        computed by exactly one DP rank, on the last stage)."""
        out = torch.zeros(num_rows, width, dtype=torch.float32, device=training_device())
        if self.is_last_stage:
            for rows, values in parts:
                if rows.numel():
                    out[rows.to(out.device, non_blocking=True)] = values.detach().float()
        if self.dp_size > 1:
            dist.all_reduce(out, group=self.pg.dp)
        if self.pp_size > 1:
            dist.all_reduce(out, group=self.pg.pp)
        return out

    @contextlib.contextmanager
    def config_hyperparameters_kept(self):
        """Around a checkpoint load: keep this engine's hyperparameters, built from the config.

        megatron's optimizer load replaces every param group's settings with the saved ones
        (max_lr, min_lr, betas, eps, ...), and the scheduler derives each step's lr from the
        group's max_lr / min_lr; so a resumed run would keep the checkpoint's lr whatever its
        config says (config/resume.py). The groups' own settings are put back after the load,
        and lr and weight decay recomputed from the scheduler's restored step counter."""
        if self.optimizer is None:
            yield
            return
        groups = [g for opt in optim_step.sub_optimizers(self.optimizer) for g in opt.optimizer.param_groups]
        kept = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        yield
        groups = [g for opt in optim_step.sub_optimizers(self.optimizer) for g in opt.optimizer.param_groups]
        for group, settings in zip(groups, kept, strict=True):
            group.update(settings)
        self.scheduler.step(0)

    def num_parameters(self) -> int:
        """Parameters of this rank's chunks (for logs)."""
        return sum(p.numel() for m in self.model for p in m.parameters())


def training_device() -> torch.device:
    """The device this rank's models train on: the current CUDA device, or the CPU
    (trainer.device decides, utils/device.py)."""
    return compute_device()


def _build_optimizer(optim, model, dtype: str, use_distributed_optimizer: bool, pg_collection):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        params_dtype=DTYPES[dtype],
        # fp16: dynamic loss scaling (loss_scale=None); megatron's defaults for the window.
        loss_scale=None,
        initial_loss_scale=2.0**16,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    # The role's groups (megatron refuses gloo groups beside a collection; only its legacy
    # dp_zero checkpoint format and the memory-efficient fully_reshardable exchange use them,
    # and neither is used here).
    with _optimizer_world(getattr(pg_collection, "intra_dist_opt", None)):
        optimizer = get_megatron_optimizer(config, model, use_gloo_process_groups=False,
                                           pg_collection=pg_collection)
    optim_step.prefer_fused_adam(optimizer)
    return optimizer


@contextlib.contextmanager
def _optimizer_world(group):
    """While megatron builds an optimizer, the default group means `group` (the role's set).

    megatron-core 0.16.1's get_megatron_optimizer aligns the parameter groups of all ranks with
    an all_gather_object over the default group (optimizer/__init__.py, _get_param_groups), so
    a role on a subset of the ranks would wait there for ranks that never build it. Its
    optimizer instance is the set (`intra_dist_opt`); the world-wide calls are pointed there
    for the duration of the build. Colocated (the set is the world) nothing is replaced."""
    if group is None or dist.get_world_size(group) == dist.get_world_size():
        yield
        return
    get_world_size, all_gather_object = dist.get_world_size, dist.all_gather_object

    def set_size(group_=None):
        return get_world_size(group if group_ is None else group_)

    def set_gather(object_list, obj, group_=None):
        return all_gather_object(object_list, obj, group=group if group_ is None else group_)

    dist.get_world_size, dist.all_gather_object = set_size, set_gather
    try:
        yield
    finally:
        dist.get_world_size, dist.all_gather_object = get_world_size, all_gather_object


def _build_scheduler(optim, optimizer, lr_decay_steps: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = optim.lr_warmup_steps
    decay_steps = max(lr_decay_steps, warmup + 1)
    # override: a checkpoint's load_state_dict keeps this config's schedule (lr, min_lr, warmup,
    # decay style and length, weight decay) and restores only the step counter, so a changed
    # actor.optim.lr applies on resume (megatron's default keeps the checkpoint's values).
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_schedule,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )
