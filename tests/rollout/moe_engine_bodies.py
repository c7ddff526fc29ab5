"""Rank bodies for the native engine's mixture-of-experts tests (module level: spawn pickles
them by name)."""
from __future__ import annotations

from tests.rollout import engine_bodies as eb


def greedy_body(rank, world_size, hf_dir: str, tp_gen: int, flat_buffer: bool, grouped: bool,
                fused: bool = False):
    """Greedy tokens and log-probs of the TP_g engine on a tiny MoE model, with the generation
    weights in the repartition's flat buffer (as the trainer holds them) or loaded on their own,
    with the experts' GEMMs grouped (torch._grouped_mm) or one per expert, and through the
    fused decode step (its ops' torch references on CPU) or the plain one."""
    from verl_mcore.rollout import native

    supported = native._CachedGPT.fused_decode_supported
    if fused:
        native._CachedGPT.fused_decode_supported = lambda self: None
    try:  # the ranks are pooled processes: restore the class for the next task
        res = _greedy(tp_gen, hf_dir, flat_buffer, grouped)
    finally:
        native._CachedGPT.fused_decode_supported = supported
    return res


def _greedy(tp_gen: int, hf_dir: str, flat_buffer: bool, grouped: bool):
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
            "moe_layers": len(moe), "fused": engine.fused, "grouped": [m.grouped for m in moe],
            # In the flat buffer the stacked experts are views of it, not copies.
            "views_of_buffer": storage is not None and all(
                m.w13.untyped_storage().data_ptr() == storage and
                m.w2.untyped_storage().data_ptr() == storage for m in moe),
            "last_experts": [tuple(m.last_experts.shape) for m in moe]}


def repartition_body(rank, world_size, hf_dir: str, pp: int, ep: int, tp_gen: int):
    """A training model at PP x EP (TP 1; DP = world / PP) from the HF weights, repartitioned
    into the TP_g generation model (every expert on every rank): the generation weights against
    the same model loaded from HF at TP_g, the bytes each rank received against the lower
    bound, and the engine's greedy tokens on the repartitioned weights."""
    import torch

    from verl_mcore.config import Config
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups
    from verl_mcore.models.load import build_and_load
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.repartition import Repartitioner, global_param_names

    cpu_compat.install()
    torch.manual_seed(0)
    cfg = Config.load(None, [f"parallel.pipeline_model_parallel_size={pp}",
                             f"parallel.expert_model_parallel_size={ep}",
                             f"rollout.tensor_parallel_size={tp_gen}"])
    groups = build_groups(cfg)
    train, arch = build_and_load("actor", hf_path=hf_dir, dtype="fp32", pp=pp,
                                 expert_model_parallel_size=ep)
    _, gen = eb.generation_model(hf_dir, groups, tp_gen, 1, load=False)
    rep = Repartitioner([train], gen, groups, gated_linear_unit=True)
    stats = rep.run()
    _, ref = eb.generation_model(hf_dir, groups, tp_gen, 1)
    want = global_param_names(ref)
    got = global_param_names(gen)
    mismatched = sorted(n for n, p in got.items() if not torch.equal(p, want[n]))
    engine = NativeEngine(gen, vocab_size=arch.vocab_size, tp_group=groups.gen_tp, max_num_seqs=3)
    sp = SamplingParams(temperature=0.0, max_new_tokens=eb.MAX_NEW)
    tokens = [o.token_ids for o in sorted(engine.generate(eb.PROMPTS, sp),
                                          key=lambda o: o.prompt_index)]
    expert_bytes = sum(p.numel() * p.element_size() for n, p in got.items()
                       if ".local_experts." in n)
    return {"mismatched": mismatched, "names": len(got), "tokens": tokens,
            "received": stats.bytes_received, "lower_bound": stats.min_bytes_received,
            "gen_bytes": stats.generation_bytes, "expert_bytes": expert_bytes,
            "train_bytes": sum(p.numel() * p.element_size() for p in train.parameters())}


def routing_body(rank, world_size, hf_dir: str, fused: bool = False):
    """The engine recording routing (record_routing=True): sampled generation (n = 2 samples
    sharing their prompt's prefill, more sequences than slots, several decode rounds) and a
    serving session with a continuation of a kept session. Each output's routed_experts
    against the experts MoEDecodeMLP.route picks on the hidden states of a teacher-forced
    megatron forward of prompt + response (row j: the position before response token j), and
    the same generation without recording (the tokens must not change)."""
    from verl_mcore.rollout import native

    supported = native._CachedGPT.fused_decode_supported
    if fused:
        native._CachedGPT.fused_decode_supported = lambda self: None
    try:  # the ranks are pooled processes: restore the class for the next task
        return _routing(hf_dir)
    finally:
        native._CachedGPT.fused_decode_supported = supported


def _routing(hf_dir: str):
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.serving import Request

    groups = eb.setup(1, 1)
    arch, model = eb.generation_model(hf_dir, groups, 1, 1)
    kwargs = dict(vocab_size=arch.vocab_size, max_num_seqs=3, steps_per_sync=3)
    engine = NativeEngine(model, record_routing=True, **kwargs)
    sp = SamplingParams(temperature=1.0, n=2, max_new_tokens=eb.MAX_NEW, seed=5, logprobs=True)
    outputs = engine.generate(eb.PROMPTS, sp)
    plain = NativeEngine(model, **kwargs).generate(eb.PROMPTS, sp)
    with engine.serving(sp, max_len=64, sessions=2) as server:
        server.submit(Request(tuple(eb.PROMPTS[0]), key=1, session="a"))
        server.submit(Request(tuple(eb.PROMPTS[2]), key=2, prompt_index=1))
        served = []
        while server.busy:
            served += [o for _, o in server.step()]
        first = next(o for o in served if o.prompt_index == 0)
        context = (*eb.PROMPTS[0], *first.token_ids, 9, 10)  # the session's next turn
        server.submit(Request(context, key=3, session="a", prompt_index=7))
        while server.busy:
            served += [o for _, o in server.step()]

    contexts = [(eb.PROMPTS[o.prompt_index], o) for o in outputs]
    contexts += [(eb.PROMPTS[0] if o.prompt_index == 0 else eb.PROMPTS[2] if o.prompt_index == 1
                  else list(context), o) for o in served]
    bad, shapes = routing_errors(model, engine, contexts)
    return {"bad": bad, "shapes": sorted(shapes), "outputs": len(contexts),
            "same_tokens": [o.token_ids for o in outputs] == [o.token_ids for o in plain],
            "plain_extras": [o.extras for o in plain][:1], "layers": len(engine.net.layers),
            "topk": arch.moe.topk}


def routing_errors(model, engine, samples) -> tuple[list, set]:
    """(samples whose routed_experts are not what `engine`'s MoE MLPs route on the hidden
    states of a teacher-forced megatron forward of `model`, as (prompt, sample, layer); the
    routing shapes seen) for `samples` [(context, SampleOutput)]. Row j of a sample is the
    routing of the position before response token j; tokens of loss mask 0 (observations, which
    no forward produced) and dense layers hold -1."""
    import numpy as np
    import torch

    moe = {i: m for i, m in enumerate(engine.net.mlps) if hasattr(m, "route")}
    seen = {}
    hooks = [engine.net.layers[i].mlp.register_forward_pre_hook(
        lambda m, args, i=i: seen.__setitem__(i, args[0].detach())) for i in moe]
    bad, shapes = [], set()
    try:
        with torch.no_grad():
            for prompt, out in samples:
                got = np.asarray(out.extras["routed_experts"])
                shapes.add(tuple(got.shape[1:]))
                ids = torch.as_tensor([*prompt, *out.token_ids[:-1]]).unsqueeze(0)
                model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)
                p, r = len(prompt), len(out.token_ids)
                own = np.asarray(out.loss_mask if out.loss_mask is not None else [1] * r, bool)
                if got.shape[0] != r or (got[~own] != -1).any():
                    bad.append((out.prompt_index, out.sample_index, "length or observations"))
                    continue
                for i, m in moe.items():
                    x = seen[i][p - 1:p - 1 + r, 0]  # [r, H]: the positions that produced them
                    want = np.sort(m.route(x)[1].numpy(), -1)[own]
                    if not np.array_equal(np.sort(got[:, i], -1)[own], want):
                        bad.append((out.prompt_index, out.sample_index, i))
                dense = [i for i in range(len(engine.net.layers)) if i not in moe]
                if dense and (got[:, dense] != -1).any():
                    bad.append((out.prompt_index, out.sample_index, "dense"))
    finally:
        for h in hooks:
            h.remove()
    return bad, shapes
