"""Weight-sync check: does the engine sample from the model the trainer is training?

After a weight update the trainer recomputes the log-probs of a few sequences the engine sampled
with log-probs: on the engine's ranks, a few of the step's own samples (`checked_outputs`: the
check costs the trainer one small forward, not a generation of its own); with a rollout set of its
own, a few sequences sampled for the check (`check_across_sets`). The absolute differences (max
and mean over all tokens of all ranks) are returned as `rollout/logprob_diff_max` /
`rollout/logprob_diff_mean`, and above the bound every rank raises `WeightSyncError` together,
before any rank trains on the batch, so a broken repartition or weight push stops the run instead
of silently training on samples from another model.

The trainer side is a callable `(prompts, responses, temperature) -> per-sequence log-probs`;
`model_logprobs_fn` makes one from a training model with no pipeline parallelism. Where the engine
recorded its routing (actor.router_replay=rollout) the callable also takes `routing=` (per
sequence [tokens, layers, k] or None) and the actor replays it, as its training passes do: the
check then compares the weights, not the routers' near-ties.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from verl_mcore.distributed.groups import collective_device
from verl_mcore.engine.batch import TrainBatch, response_aligned
from verl_mcore.engine.logprobs import mask_padded_vocab
from verl_mcore.errors import WeightSyncError
from verl_mcore.ops import logprob_entropy
from verl_mcore.rollout.base import RolloutEngine, SampleOutput, SamplingParams
from verl_mcore.rollout.batch import Rollout
from verl_mcore.rollout.gather import agreed_failure, broadcast_part, gather_rollout
from verl_mcore.rollout.token_fields import ROUTED_EXPERTS

logger = logging.getLogger(__name__)

TrainerLogprobs = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]], float],
                           Sequence[torch.Tensor]]


def model_logprobs_fn(model: torch.nn.Module, vocab_size: int, tp_group=None) -> TrainerLogprobs:
    """Trainer log-probs from a GPTModel holding every layer (PP = 1), at any TP.

    Each prompt + response is one right-padded row of a causal forward; the logits of padded
    vocabulary ids (>= vocab_size) get no probability mass, as in the engine and the actor
    (engine.logprobs.mask_padded_vocab). Uses `verl_mcore.ops.logprob_entropy` over the
    vocab-parallel logits.
    """
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise ValueError("model_logprobs_fn: the model is one pipeline stage; pass the trainer's "
                         "own log-prob callable for PP > 1")

    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1

    @torch.no_grad()
    def logprobs(prompts, responses, temperature):
        mine = len(prompts)
        offset = 0
        if tp_size > 1:
            # The TP ranks of the training model must run one batch together; each brings the
            # sequences of its own generation replica.
            everyone = [None] * tp_size
            dist.all_gather_object(everyone, (list(prompts), list(responses)), group=tp_group)
            offset = sum(len(p) for p, _ in everyone[: dist.get_rank(tp_group)])
            prompts = [p for ps, _ in everyone for p in ps]
            responses = [r for _, rs in everyone for r in rs]
        device = next(model.parameters()).device
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        s = max(map(len, seqs))
        tokens = torch.zeros(len(seqs), s, dtype=torch.long)
        for i, q in enumerate(seqs):
            tokens[i, : len(q)] = torch.as_tensor(q)
        tokens = tokens.to(device)
        positions = torch.arange(s, device=device).expand(len(seqs), s)
        was_training = model.training
        model.eval()
        logits = model(tokens, positions, None)  # [b, s, V_local]
        model.train(was_training)
        start = (dist.get_rank(tp_group) if tp_group is not None else 0) * logits.shape[-1]
        logits = mask_padded_vocab(logits.float(), vocab_size, tp_group)
        # Position t predicts token t + 1.
        target = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
        logp, _ = logprob_entropy(logits, target, tp_group=tp_group, temperature=temperature or 1.0,
                                  vocab_start=start, compute_entropy=False)
        return [logp[i, len(prompts[i]) - 1: len(prompts[i]) - 1 + len(responses[i])]
                for i in range(offset, offset + mine)]

    return logprobs


def checked_outputs(outputs: Sequence[SampleOutput], count: int, max_tokens: int
                    ) -> list[SampleOutput]:
    """The step's own samples the check reads: up to `count` outputs, one per prompt first (a
    broken weight shows on any prompt, and different prompts cover more of the model than the
    samples of one), each cut to its first `max_tokens` response tokens (0: whole). A causal
    model's log-probs of a prefix do not depend on what follows, so the cut changes nothing but
    the trainer's cost."""
    firsts, rest, seen = [], [], set()
    for o in outputs:
        (rest if o.prompt_index in seen else firsts).append(o)
        seen.add(o.prompt_index)
    chosen = (firsts + rest)[:count]
    if max_tokens:
        chosen = [dataclasses.replace(o, token_ids=list(o.token_ids)[:max_tokens],
                                      logprobs=list(o.logprobs)[:max_tokens],
                                      extras={k: v[:max_tokens] for k, v in o.extras.items()})
                  for o in chosen]
    return chosen


def check_weight_sync(outputs: Sequence[SampleOutput], prompts: Sequence[Sequence[int]], trainer: TrainerLogprobs,
                      temperature: float, max_abs_diff: float, group=None) -> dict[str, float]:
    """Compare the engine's log-probs of sampled `outputs` (sampled with `logprobs`;
    `prompt_index` into `prompts`) with the trainer's log-probs of the same tokens.

    Every rank calls this (collective over `group`, default: the world): each generation replica
    passes its own outputs; the max / mean are over every token of every rank. Raises
    WeightSyncError on all ranks when the max exceeds `max_abs_diff`.
    """
    if any(o.logprobs is None for o in outputs):
        raise ValueError("check_weight_sync: the outputs were sampled without logprobs=True")
    routing = [o.extras.get(ROUTED_EXPERTS) for o in outputs]
    replay = {"routing": routing} if any(r is not None for r in routing) else {}
    theirs = trainer([prompts[o.prompt_index] for o in outputs], [o.token_ids for o in outputs],
                     temperature, **replay)
    diffs = [torch.as_tensor(o.logprobs, dtype=torch.float64)
             - torch.as_tensor(t, dtype=torch.float64).detach().cpu().reshape(-1)
             for o, t in zip(outputs, theirs)]
    flat = torch.cat(diffs).abs() if diffs else torch.zeros(0, dtype=torch.float64)
    stats = torch.tensor([flat.max().item() if flat.numel() else 0.0], dtype=torch.float64)
    total = torch.tensor([flat.sum().item(), float(flat.numel())], dtype=torch.float64)
    if dist.is_initialized():
        backend_device = collective_device(group)
        stats, total = stats.to(backend_device), total.to(backend_device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    worst, mean = stats[0].item(), total[0].item() / max(total[1].item(), 1.0)
    return _verdict(worst, mean, int(total[1].item()), max_abs_diff)


def _verdict(worst: float, mean: float, tokens: int, max_abs_diff: float) -> dict[str, float]:
    """The check's metrics, or WeightSyncError above the bound (every rank saw the same
    numbers, so every rank raises alike)."""
    metrics = {"rollout/logprob_diff_max": worst, "rollout/logprob_diff_mean": mean}
    logger.info("weight sync check: max |engine - trainer| log-prob %.3g, mean %.3g over %d tokens",
                worst, mean, tokens)
    if not worst <= max_abs_diff:  # also catches NaN
        raise WeightSyncError(
            f"weight sync check failed: the rollout engine's log-probs differ from the trainer's by "
            f"up to {worst:.4g} (mean {mean:.4g}) over {tokens} sampled tokens, above "
            f"rollout.logprob_check.max_abs_diff={max_abs_diff}. The generation weights do not "
            "match the actor: check the repartition / weight push (or raise the bound for low "
            "precision).")
    return metrics


def check_across_sets(engine: Optional[RolloutEngine], actor, prompts, sampling: SamplingParams,
                      max_abs_diff: float, *, link, rollout_groups, rollout_leader: int,
                      actor_leader: int, vocab_size: int, pad_token_id: int) -> dict[str, float]:
    """The weight-sync check of a rollout set of its own (placement.rollout), right after the
    actor's weights reached it: the rollout set samples one response per prompt of `prompts`
    (each replica its own) with log-probs, the sequences go to the actor set as tensors
    (rollout.gather.broadcast_part over `link`, the two sets' ranks), the actor recomputes the
    log-probs of the same tokens with its training weights, and its verdict comes back to the
    rollout set: every rank of both sets returns the same metrics or raises WeightSyncError.

    Rollout ranks pass `engine` (and `prompts`), actor ranks `actor`; both call it together."""
    class _Prompts:  # what Rollout.from_outputs reads of a PromptBatch
        def __init__(self, ids):
            self.input_ids, self.rows = ids, [None] * len(ids)

    # A failure on any rank of either set is agreed before the next exchange (agreed_failure),
    # so the other set never waits in one its peer left.
    part, failure = None, None
    if engine is not None:
        mine = None
        try:
            outputs = engine.generate(prompts, dataclasses.replace(sampling, n=1, logprobs=True))
            if rollout_groups.gen_tp_rank == 0:
                mine = Rollout.from_outputs(_Prompts(list(prompts)), outputs, vocab_size)
        except Exception as e:  # noqa: BLE001 - raised on both sets by broadcast_part
            failure = e
        failure = agreed_failure(failure, rollout_groups.whole, "gathering the check's samples")
        if failure is None:
            part = gather_rollout(mine, rollout_groups, vocab_size)
    part = broadcast_part(part, rollout_leader, link, vocab_size, with_rows=False,
                          failure=failure, who="the rollout set")
    device = collective_device(link)
    verdict = torch.zeros(3, dtype=torch.float64)  # max |diff|, sum |diff|, tokens
    if actor is not None:
        try:
            batch = TrainBatch.from_flat(part.prompt_ids, part.prompt_lens, part.response_ids,
                                         part.response_lens, pad_token_id,
                                         prompt_of=part.prompt_of)
            routed = part.token_fields.get(ROUTED_EXPERTS)
            if routed is not None:  # replayed, as in training
                batch = dataclasses.replace(batch, routed_experts=response_aligned(
                    routed, part.response_lens, batch.response_width, fill=-1))
            logp, _ = actor.compute_log_prob(batch, measure_replay=False)
            # The response tokens in order, as the engine's flat log-probs have them.
            trainer = logp.detach().cpu().double()[batch.response_mask.cpu().bool()]
            diff = (part.logprobs.double() - trainer).abs()
            if diff.numel():
                verdict = torch.tensor([diff.max().item(), diff.sum().item(),
                                        float(diff.numel())], dtype=torch.float64)
        except Exception as e:  # noqa: BLE001 - agreed below
            failure = e
    failure = agreed_failure(failure, link, "the weight-sync check's verdict")
    if failure is not None:
        raise failure
    verdict = verdict.to(device)
    dist.broadcast(verdict, src=actor_leader, group=link)
    worst, total, count = verdict.cpu().tolist()
    return _verdict(worst, total / max(count, 1.0), int(count), max_abs_diff)
