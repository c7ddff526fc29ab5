"""Rank bodies for the native engine's mixture-of-experts tests (module level: spawn pickles
them by name)."""
from __future__ import annotations

from tests.rollout import engine_bodies as eb


def greedy_body(rank, world_size, hf_dir: str, tp_gen: int, flat_buffer: bool, grouped: bool):
    """Greedy tokens and log-probs of the TP_g engine on a tiny MoE model, with the generation
    weights in the repartition's flat buffer (as the trainer holds them) or loaded on their own,
    and with the experts' GEMMs grouped (torch._grouped_mm) or one per expert."""
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.repartition import FlatParameterBuffer

    groups = eb.setup(tp_gen, tp_gen)
    arch, model = eb.generation_model(hf_dir, groups, tp_gen, tp_gen)
    buffer = FlatParameterBuffer(model) if flat_buffer else None
    engine = NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp, max_num_seqs=3)
    moe = [m for m in engine.net.mlps if hasattr(m, "grouped")]
    for m in moe:
        m.grouped = m.grouped and grouped
    sp = SamplingParams(temperature=0.0, max_new_tokens=eb.MAX_NEW, logprobs=True)
    out = sorted((o.prompt_index, o.token_ids, o.logprobs) for o in engine.generate(eb.PROMPTS, sp))
    storage = buffer.buffer.untyped_storage().data_ptr() if buffer is not None else None
    return {"tokens": [o[1] for o in out], "logprobs": [o[2] for o in out],
            "moe_layers": len(moe), "grouped": [m.grouped for m in moe],
            # In the flat buffer the stacked experts are views of it, not copies.
            "views_of_buffer": storage is not None and all(
                m.w13.untyped_storage().data_ptr() == storage and
                m.w2.untyped_storage().data_ptr() == storage for m in moe),
            "last_experts": [tuple(m.last_experts.shape) for m in moe]}
