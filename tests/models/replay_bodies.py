"""Rank bodies for the routing-replay tests (module level: spawn pickles them by name)."""
from __future__ import annotations

import dataclasses

import torch


def _log_probs(model, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token [b, s - 1] under the megatron model (one rank, fp32)."""
    b, s = tokens.shape
    with torch.no_grad():
        logits = model(tokens, torch.arange(s).expand(b, s), None)  # [b, s, V]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]


def near_tie_body(rank, world_size, hf_dir: str, tokens: torch.Tensor, position: int, layer: int,
                  eps: float):
    """Two copies of the model: the trainer's, whose router at `layer` scores the k-th and
    (k+1)-th experts of token `position` within `eps` of each other, and the engine's, equal but
    for that router's scores of the (k+1)-th expert being 2 eps higher there, so that it routes
    the token to it (what another kernel's rounding does to a near-tie). Returns the trainer's
    log-probs without and with the engine's routing replayed, the engine's own, and the
    replay's mismatch count."""
    from megatron.core.transformer.moe.router import TopKRouter

    from tests.models.moe_bodies import setup_megatron
    from verl_mcore.models.load import build_and_load
    from verl_mcore.models.router_replay import ForcedRouting

    setup_megatron(1, 1, 1)
    trainer, arch = build_and_load("actor", hf_path=hf_dir, dtype="fp32")
    engine, _ = build_and_load("actor", hf_path=hf_dir, dtype="fp32")
    trainer.eval(), engine.eval()

    def router(model):
        return next(m for m in model.modules()
                    if isinstance(m, TopKRouter) and m.layer_number - 1 == layer)

    seen = {}
    hook = router(trainer).register_forward_pre_hook(
        lambda m, args: seen.setdefault("x", args[0].detach().reshape(-1, arch.hidden_size)))
    _log_probs(trainer, tokens)
    hook.remove()
    x = seen["x"][position].double()  # batch 1: row = position
    k = arch.moe.topk
    with torch.no_grad():
        weight = router(trainer).weight
        scores = weight.double() @ x
        kth, next_ = torch.argsort(scores, descending=True)[k - 1: k + 1].tolist()
        # trainer: expert `next_` eps below the k-th; engine: eps above it
        weight[next_] += ((scores[kth] - scores[next_] - eps) / x.dot(x) * x).float()
        router(engine).weight.copy_(weight)
        router(engine).weight[next_] += (2 * eps / x.dot(x) * x).float()
    engine_replay = ForcedRouting([engine])
    engine_lp = _log_probs(engine, tokens)
    recorded = engine_replay.own_choices(tokens.shape[0])  # what the engine routed to
    replay = ForcedRouting([trainer])
    plain = _log_probs(trainer, tokens)
    replay.mismatch()  # only the replayed pass counts
    replay.force(recorded)
    replayed = _log_probs(trainer, tokens)
    differed, forced = replay.mismatch()
    replay.force(None)
    return {"engine": engine_lp, "plain": plain, "replayed": replayed, "differed": differed,
            "forced": forced, "moe_layers": len(arch.moe.layers), "flipped": (kth, next_),
            "engine_chose": recorded[0, position, layer].tolist()}


class _Tokenizer:  # what Rollout.for_learner reads of one
    def batch_decode(self, lists, skip_special_tokens=True):
        return [" ".join(map(str, ids)) for ids in lists]


def trainer_path_body(rank, world_size, hf_dir: str, prompt: list, layer: int, eps: float):
    """Routing replay through the run's data path: the native engine (recording its routing)
    samples from a copy of the model whose router at `layer` breaks a near-tie at the prompt's
    last position the other way than the trainer's does; the samples become a Rollout (the
    declared routed_experts field), the learner's TrainBatch, micro-batches (packed and padded)
    and the actor's old log-probs, the reference's log-probs and one update. Returns the
    log-probs with and without the routing, the engine's own, the replay's counts and metric,
    and whether the update moved the router."""
    from types import SimpleNamespace

    from megatron.core.process_groups_config import ProcessGroupCollection

    from tests.models.moe_bodies import setup_megatron
    from verl_mcore.config.schema import ActorConfig, OptimConfig
    from verl_mcore.engine.actor import Actor, Reference, compute_log_probs
    from verl_mcore.engine.engine import MegatronEngine
    from verl_mcore.generation import GenerationPhase
    from verl_mcore.models.gpt import build_gpt_model, unwrap
    from verl_mcore.models.hf_config import read_hf_arch, transformer_config
    from verl_mcore.models.hf_weights import load_hf_weights
    from verl_mcore.models.load import build_and_load
    from verl_mcore.rollout import token_fields
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.batch import Rollout
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.sync_check import check_weight_sync

    setup_megatron(1, 1, 1)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    arch = read_hf_arch(hf_dir)

    def role(optim):
        def provider(config, pre_process, post_process, vp_stage):
            return build_gpt_model(arch, config, role="actor", pre_process=pre_process,
                                   post_process=post_process, vp_stage=vp_stage, pg_collection=pg)
        return MegatronEngine(provider, transformer_config(arch, tp=1, pp=1, dtype="fp32"), pg,
                              dtype="fp32", optim=optim, use_distributed_optimizer=False,
                              load_weights=lambda m: load_hf_weights(m, arch, hf_dir, role="actor"),
                              vocab_size=arch.vocab_size, router_replay=True)

    actor_engine, ref_engine = role(OptimConfig(lr=1e-2, clip_grad=0.0)), role(None)
    trainer, reference = unwrap(actor_engine.model[0]), unwrap(ref_engine.model[0])
    gen, _ = build_and_load("actor", hf_path=hf_dir, dtype="fp32")
    trainer.eval()
    seen = {}
    hook = _router(trainer, layer).register_forward_pre_hook(
        lambda m, args: seen.setdefault("x", args[0].detach().reshape(-1, arch.hidden_size)))
    _log_probs(trainer, torch.as_tensor([prompt]))
    hook.remove()
    x = seen["x"][len(prompt) - 1].double()  # the position that samples the first token
    with torch.no_grad():
        weight = _router(trainer, layer).weight
        scores = weight.double() @ x
        kth, next_ = torch.argsort(scores, descending=True)[arch.moe.topk - 1: arch.moe.topk + 1].tolist()
        weight[next_] += ((scores[kth] - scores[next_] - eps) / x.dot(x) * x).float()
        _router(reference, layer).weight.copy_(weight)
        _router(gen, layer).weight.copy_(weight)
        _router(gen, layer).weight[next_] += (2 * eps / x.dot(x) * x).float()
    before = weight.detach().clone()

    token_fields.declare(token_fields.routing_field(arch.num_layers, arch.moe.topk))
    try:
        engine = NativeEngine(gen, vocab_size=arch.vocab_size, record_routing=True)
        outputs = engine.generate([prompt], SamplingParams(temperature=1.0, n=2, max_new_tokens=6,
                                                           seed=3, logprobs=True))
        prompts = SimpleNamespace(input_ids=[prompt], rows=[None])
        info = SimpleNamespace(tokenizer=_Tokenizer(), eos_token_ids=[0], pad_token_id=0)
        rollout = Rollout.from_outputs(prompts, outputs, arch.vocab_size).for_learner(info)
    finally:
        token_fields.retract("routed_experts")
    batch = rollout.train
    cfg = ActorConfig(max_tokens_per_microbatch=64, micro_batch_size_per_gpu=None)
    actor = Actor(actor_engine, cfg, mini_batch_size=batch.num_samples)
    replayed, _ = actor.compute_log_prob(batch)
    counts = actor._replayed
    plain, _ = compute_log_probs(actor_engine, dataclasses.replace(batch, routed_experts=None), 1.0,
                                 {"max_tokens": 64}, False)
    padded, _ = compute_log_probs(actor_engine, batch, 1.0, {"micro_batch_size": 1}, False)
    ref = Reference(ref_engine, max_tokens_per_microbatch=64).compute_ref_log_prob(batch)
    # The weight-sync check replays the routing too: it compares the weights, not near-ties.
    phase = GenerationPhase(engine, actor, SimpleNamespace(gen_tp_rank=0, gen_dp_rank=0), None,
                            (), 6, 0)
    check = {name: check_weight_sync(outs, [prompt], phase.actor_logprobs, 1.0, 10.0)
             ["rollout/logprob_diff_max"] for name, outs in (
                 ("replayed", outputs), ("plain", [dataclasses.replace(o, extras={}) for o in outputs]))}
    summary, _ = actor.update(dataclasses.replace(
        batch, old_log_probs=replayed, advantages=torch.tensor([[1.0], [-1.0]]).expand_as(replayed)))
    mask = batch.response_field_mask()
    return {"check": check, "engine": rollout.engine_log_probs[mask], "replayed": replayed[mask],
            "plain": plain[mask], "padded": padded[mask], "reference": ref[mask],
            "counts": counts, "metric": summary["actor/router_replay_mismatch"],
            "first_routed": batch.routed_experts[:, 0, layer].tolist(), "flipped": (kth, next_),
            "router_moved": float((_router(trainer, layer).weight - before).abs().max()),
            "moe_layers": len(arch.moe.layers), "tokens": int(mask.sum())}


def _router(model, layer: int):
    from megatron.core.transformer.moe.router import TopKRouter

    return next(m for m in model.modules() if isinstance(m, TopKRouter) and m.layer_number - 1 == layer)
