"""Actor and reference roles: log-probs (forward only) and the PPO policy update.

One actor update (`Actor.update`), for a global batch of B samples:

    for epoch in range(ppo_epochs):
        for each mini-batch of `mini_batch_size` consecutive samples:     # one optimizer step
            denominators of the mini-batch (all of its tokens, all DP ranks; the batch is global)
            micro-batches: packed by token budget or padded, balanced over DP ranks
            loss = sum over micro-batches and DP ranks of
                   policy_loss + entropy_bonus (-coeff * entropy) + kl_loss_coef * kl_loss
                   (each term a contribution with the mini-batch's global denominators, so the sum
                    is the mini-batch loss under actor.loss_agg_mode whatever the split)
            optimizer step (grad clip, LR schedule)

Metrics per optimizer step are the mini-batch values (token means for the diagnostics), reduced
over DP exactly like the gradients; `update` returns their mean over steps plus grad_norm, lr,
throughput and MFU.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from verl_mcore.algo.aggregation import LossDenominators
from verl_mcore.algo.kl import kl_loss
from verl_mcore.algo.policy_loss import PolicyLossParams, compute_policy_loss, entropy_bonus
from verl_mcore.engine.batch import TrainBatch
from verl_mcore.engine.engine import MegatronEngine
from verl_mcore.engine.flops import measured_matmul_ceiling, peak_flops, sequence_flops
from verl_mcore.engine.logprobs import response_logprobs
from verl_mcore.engine.offload import HostOffloader
from verl_mcore.models.gpt import unwrap
from verl_mcore.models.lora import adapters_disabled
from verl_mcore.utils.device import cuda_in_use


def _model_vocab(engine: MegatronEngine) -> int:
    return int(unwrap(engine.model[0]).vocab_size)


def loss_mask(mb) -> torch.Tensor:
    """[n, R] bool: response tokens that count (the batch's mask, inside the response)."""
    return mb.fields["response_mask"].bool() & mb.gather_valid


def micro_batching(max_tokens: Optional[int], micro_batch_size: Optional[int]) -> dict:
    """Keyword arguments of MegatronEngine.micro_batches: the token budget wins when set."""
    if max_tokens is not None:
        return {"max_tokens": max_tokens}
    if micro_batch_size is None:
        raise ValueError("set max_tokens_per_microbatch (packed) or micro_batch_size_per_gpu (padded)")
    return {"micro_batch_size": micro_batch_size}


def compute_log_probs(
    engine: MegatronEngine, batch: TrainBatch, temperature: float, mb_kwargs: dict, compute_entropy: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Forward-only log-probs (and entropies) `[B, R]` of the batch's response tokens, every rank."""
    mbs = engine.micro_batches(batch, **mb_kwargs)
    tp_group = engine.pg.tp
    logp_parts, ent_parts = [], []

    def collect(logits, mb):
        logp, ent = response_logprobs(logits, mb, tp_group, temperature, compute_entropy,
                                      vocab_size=engine.vocab_size)
        logp_parts.append((mb.rows, logp))
        if ent is not None:
            ent_parts.append((mb.rows, ent))
        return None, {}

    engine.forward_backward(mbs, collect, forward_only=True)
    b, r = batch.num_samples, batch.response_width
    logp = engine.gather_rows(logp_parts, b, r)
    entropy = engine.gather_rows(ent_parts, b, r) if compute_entropy else None
    return logp, entropy


class Reference:
    """Forward-only reference policy (no optimizer, no grads).

    offload_params (reference.offload_params): the weights live in pinned host memory and come
    to the device only for `compute_ref_log_prob` (one host-to-device copy per call; the host
    copy is never written back, the weights do not change). The memory they free while away is
    left in torch's cache for the phases that follow.
    """

    def __init__(self, engine: MegatronEngine, *, temperature: float = 1.0,
                 max_tokens_per_microbatch: Optional[int] = None, micro_batch_size: Optional[int] = None,
                 offload_params: bool = False, adapters_off: bool = False):
        """adapters_off: `engine` is the actor's, with LoRA adapters (models/lora.py); the
        reference is its base model, i.e. the same forward with every adapter disabled."""
        if engine.optimizer is not None and not adapters_off:
            raise ValueError("Reference: build its engine with optim=None (forward only)")
        if adapters_off and offload_params:
            raise ValueError("Reference: the actor's base model cannot be offloaded apart from "
                             "the actor (reference.offload_params with actor.lora)")
        self.engine = engine
        self.adapters_off = adapters_off
        self.temperature = temperature
        self.mb_kwargs = micro_batching(max_tokens_per_microbatch, micro_batch_size)
        self.offloader = None
        if offload_params:
            self.offloader = HostOffloader(engine.model, None, params=True, grads=False,
                                           optimizer_state=False, empty_cache=False, frozen=True)
            self.offloader.offload()

    def compute_ref_log_prob(self, batch: TrainBatch) -> torch.Tensor:
        """`[B, R]` reference log-probs of the response tokens (0 outside responses)."""
        if self.adapters_off:
            with adapters_disabled(self.engine.model):
                return compute_log_probs(self.engine, batch, self.temperature, self.mb_kwargs,
                                         False)[0]
        if self.offloader is None:
            return compute_log_probs(self.engine, batch, self.temperature, self.mb_kwargs, False)[0]
        self.offloader.onload()
        try:
            return compute_log_probs(self.engine, batch, self.temperature, self.mb_kwargs, False)[0]
        finally:
            self.offloader.offload()


class Actor:
    """The policy: old log-probs and the PPO update (see module docstring).

    cfg: ActorConfig (verl_mcore.config.schema). mini_batch_size: SAMPLES per optimizer step
    (actor.ppo_mini_batch_size prompts x rollout.n). temperature: the sampling temperature, applied
    to the logits as the sampler did. norm_len: L of loss_agg_mode seq-mean-token-sum-norm (pass
    data.max_response_length; default the batch's response width).
    """

    def __init__(self, engine: MegatronEngine, cfg, *, mini_batch_size: int, temperature: float = 1.0,
                 norm_len: Optional[float] = None, log_entropy: bool = True):
        if engine.optimizer is None:
            raise ValueError("Actor: its engine needs an optimizer (optim=cfg.actor.optim)")
        self.engine = engine
        self.cfg = cfg
        self.mini_batch_size = mini_batch_size
        self.temperature = temperature
        self.norm_len = norm_len
        self.log_entropy = log_entropy
        self.params = PolicyLossParams(
            agg_mode=cfg.loss_agg_mode, clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
        )
        self.mb_kwargs = micro_batching(cfg.max_tokens_per_microbatch, cfg.micro_batch_size_per_gpu)
        self.vocab_size = _model_vocab(engine)
        # Routing replay's counts from the old-log-prob pass over the batch being trained (the
        # weights that sampled it); None: that pass did not run, the update's passes count.
        self._replayed: Optional[tuple[int, int]] = None

    def is_on_policy_step(self, num_samples: int) -> bool:
        """Whether updating a batch of `num_samples` is one optimizer step (one epoch, one
        mini-batch): then every micro-batch sees the weights that sampled, and `update` may take
        the old log-probs from its own forward pass (see ActorConfig.recompute_old_log_probs)."""
        return self.cfg.ppo_epochs == 1 and self.mini_batch_size == num_samples

    def compute_log_prob(self, batch: TrainBatch, compute_entropy: bool = False,
                         measure_replay: bool = True):
        """Old log-probs `[B, R]` (and entropies) of the current weights, forward only.
        measure_replay: this pass gives the update's routing-replay metric (`_replay_mismatch`);
        False for other batches (the weight-sync check's)."""
        replayed = (measure_replay and self.engine.replay is not None
                    and batch.routed_experts is not None)
        if replayed:
            self.engine.replay.mismatch(reset=True)  # count this pass only
        out = compute_log_probs(self.engine, batch, self.temperature, self.mb_kwargs, compute_entropy)
        if replayed:
            self._replayed = self.engine.replay_mismatch()
        return out

    def _loss(self, denoms: LossDenominators, logits: torch.Tensor, mb) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        need_entropy = cfg.entropy_coeff != 0 or self.log_entropy
        logp, entropy = response_logprobs(logits, mb, self.engine.pg.tp, self.temperature, need_entropy,
                                          vocab_size=self.engine.vocab_size)
        mask = loss_mask(mb)
        f = mb.fields
        # No old log-probs: a one-step on-policy update (see `update`); the ratio is exactly 1
        # and its gradient is the gradient of logp.
        old_logp = f["old_log_probs"] if "old_log_probs" in f else logp.detach()
        loss, metrics = compute_policy_loss(
            cfg.policy_loss, logp, old_logp, f["advantages"], mask, denoms, self.params,
            f.get("is_weights"),
        )
        ent_term, ent_metrics = entropy_bonus(entropy, mask, denoms, cfg.entropy_coeff, cfg.loss_agg_mode)
        loss = loss + ent_term
        metrics.update(ent_metrics)
        if cfg.use_kl_loss:
            kl, kl_metrics = kl_loss(logp, f["ref_log_probs"], mask, denoms, cfg.kl_loss_type, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl
            metrics.update(kl_metrics)
        metrics["loss"] = loss.detach()
        return loss, metrics

    def update(self, batch: TrainBatch) -> tuple[dict[str, float], list[dict[str, float]]]:
        """PPO update over ppo_epochs x mini-batches. Returns (summary, per-step metrics).

        summary: mean over optimizer steps of each metric, the last step's lr, tokens_per_s (real
        tokens of all samples and epochs over the wall time, all ranks together) and mfu (None
        without a known GPU peak). Keys are prefixed "actor/".
        """
        needed = ["advantages"] + (["ref_log_probs"] if self.cfg.use_kl_loss else [])
        if not self.is_on_policy_step(batch.num_samples):
            needed.append("old_log_probs")  # several optimizer steps: the policy moves between them
        batch.require(*needed, role="Actor.update")
        replayed = self.engine.replay is not None and batch.routed_experts is not None
        if replayed and self._replayed is None:
            self.engine.replay.mismatch(reset=True)  # the update's passes count
        steps = run_ppo_epochs(
            self.engine, batch, self.mini_batch_size, self.cfg.ppo_epochs, self.mb_kwargs,
            self._loss, self.norm_len,
        )
        summary = summarize("actor", steps, self.engine, batch, self.cfg.ppo_epochs, self.vocab_size)
        if replayed:
            summary["actor/router_replay_mismatch"] = self._replay_mismatch()
        return summary, [s for s, _ in steps]

    def _replay_mismatch(self) -> Optional[float]:
        """The share of token-layer routing decisions (response tokens, MoE layers) where the
        actor's router, left to itself, would have chosen other experts than the rollout
        engine: in the old-log-prob pass when it ran (the weights that sampled), else in the
        update's passes (one on-policy step: the same weights). None when no decision was
        replayed (the engine recorded none)."""
        differed, forced = self._replayed or self.engine.replay_mismatch()
        self._replayed = None
        return differed / forced if forced else None


def run_ppo_epochs(engine, batch, mini_batch_size, epochs, mb_kwargs, loss, norm_len):
    """epochs x mini-batches optimizer steps; returns [(metrics, seconds)] per step."""
    b = batch.num_samples
    if mini_batch_size <= 0 or b % mini_batch_size:
        raise ValueError(f"batch of {b} samples is not a multiple of the mini-batch size {mini_batch_size}")
    steps = []
    for _ in range(epochs):
        for start in range(0, b, mini_batch_size):
            t0 = _now()
            mini = batch.select(range(start, start + mini_batch_size))
            valid = mini.response_mask.bool() & mini.response_field_mask()
            denoms = LossDenominators.of(valid, norm_len=norm_len)
            mbs = engine.micro_batches(mini, **mb_kwargs)
            engine.zero_grad()
            per_mb = engine.forward_backward(mbs, lambda out, mb: loss(denoms, out, mb), forward_only=False)
            stats = engine.optimizer_step()
            metrics = engine.reduce_metrics(per_mb)
            metrics.update(stats)
            metrics.update(engine.moe_metrics())
            steps.append((metrics, _now() - t0))
    return steps


def summarize(prefix, steps, engine, batch, epochs, vocab_size) -> dict[str, float]:
    keys = sorted({k for s, _ in steps for k in s})
    out = {f"{prefix}/{k}": sum(s.get(k, 0.0) for s, _ in steps) / len(steps) for k in keys}
    out[f"{prefix}/lr"] = steps[-1][0]["lr"]
    seconds = sum(t for _, t in steps)
    tokens = int(batch.seq_lens.sum()) * epochs
    out[f"{prefix}/tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
    flops = sequence_flops(engine.config, vocab_size, batch.seq_lens.tolist(), training=True) * epochs
    # No datasheet peak (CPU): against a matmul ceiling measured here (engine/flops.py).
    peak = peak_flops() or measured_matmul_ceiling()
    world = engine.tp_size * engine.pp_size * engine.dp_size  # the role's ranks, not the job's
    out[f"{prefix}/mfu"] = flops / (seconds * peak * world) if peak and seconds > 0 else None
    return out


def _now() -> float:
    if cuda_in_use():
        torch.cuda.synchronize()
    return time.perf_counter()
