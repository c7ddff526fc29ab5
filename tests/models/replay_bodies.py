"""Rank bodies for the routing-replay tests (module level: spawn pickles them by name)."""
from __future__ import annotations

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
