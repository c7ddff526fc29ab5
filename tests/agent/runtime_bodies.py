"""Rank bodies of the agent runtime tests (module level: spawn pickles them by name)."""
from __future__ import annotations

import os

from tests.rollout.engine_bodies import LONG_PROMPTS, generation_model, setup

TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_loop.py")


class _Prompts:
    def __init__(self, ids):
        self.input_ids = [list(p) for p in ids]
        self.rows = [{"index": i} for i in range(len(ids))]


def _out(o):
    return (o.prompt_index, o.sample_index, o.token_ids, o.logprobs, o.finish_reason, list(o.loss_mask),
            o.turns, o.reward, o.info)


def runtime_body(rank, world_size, hf_dir: str, tp_gen: int, cases: tuple = ("toy", "one_turn", "limits", "raises")):
    """The toy loop over a GenerationPhase of the native engine: sampled and greedy, a one-turn
    loop against generate(), limits, a loop that raises; the engine's stats of each."""
    import dataclasses

    from verl_mcore.agent.runtime import AgentLoopError, AgentRuntime
    from verl_mcore.config import Config
    from verl_mcore.generation import GenerationPhase
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.serving import Request, stream_key
    from verl_mcore.user_code import load_user_object

    groups = setup(tp_gen, tp_gen)
    arch, model = generation_model(hf_dir, groups, tp_gen, tp_gen)
    engine = NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp, block_size=4,
                          max_num_seqs=16, steps_per_sync=2)
    cfg = Config.load(None, [])
    phase = GenerationPhase(engine, None, groups, cfg.rollout, (), 32, 0)
    prompts = _Prompts(LONG_PROMPTS)

    def runtime(name, max_turns=8, **kwargs):
        cls = load_user_object(TOY, name, "rollout.agent_loop")
        return AgentRuntime(cls, kwargs, TOY, name, max_turns=max_turns, tokenizer=None, eos_token_ids=[],
                            vocab_size=arch.vocab_size)

    res = {}
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=5, logprobs=True)
    phase.begin(0)
    if "toy" in cases:
        res["toy"] = [_out(o) for o in runtime("ToyLoop")(phase, prompts, sampled)]
        res["toy_stats"] = dict(engine.last_stats)
        res["toy_metrics"] = phase.take_stats()
        # the same trajectories with other waits (and so other rounds): the same tokens
        res["toy_unstaggered"] = [_out(o) for o in runtime("ToyLoop", stagger=False, sleep_s=0.0)(phase, prompts, sampled)]
        # each model turn re-served alone from its context and stream: what the engine samples
        again = []
        for o in res["toy"]:
            for before, tokens, draws in o[8]["seen"]:
                with engine.serving(sampled, max_len=64, sessions=1) as server:
                    server.submit(Request(before, key=stream_key(5, o[0], o[1]), draws=draws, max_new_tokens=4))
                    done = []
                    while server.busy:
                        done += server.step()
                again.append((tokens, done[0][1].token_ids))
        res["toy_again"] = again
        greedy = dataclasses.replace(sampled, temperature=0.0, seed=None)
        res["toy_greedy"] = [_out(o) for o in runtime("ToyLoop")(phase, prompts, greedy)]
        res["greedy_recomputed"] = [
            [o.token_ids for o in engine.generate([before], dataclasses.replace(greedy, n=1, max_new_tokens=4))][0]
            for o in res["toy_greedy"] for before, _, _ in o[8]["seen"]]
    if "one_turn" in cases:
        one = dataclasses.replace(sampled, max_new_tokens=6)
        res["one_turn"] = [_out(o) for o in runtime("ToyLoop", turns=1, per_turn=6)(phase, prompts, one)]
        res["generated"] = [(o.prompt_index, o.sample_index, o.token_ids, o.logprobs, o.finish_reason)
                            for o in engine.generate(prompts.input_ids, one)]
    if "limits" in cases:
        res["max_turns"] = [_out(o) for o in runtime("Greedy", max_turns=2)(phase, prompts, sampled)]
        res["budget"] = [_out(o) for o in runtime("Greedy", max_turns=100)(
            phase, prompts, dataclasses.replace(sampled, max_new_tokens=12))]
    if "raises" in cases:
        try:
            runtime("Raises")(phase, prompts, sampled)
        except AgentLoopError as e:
            res["raises"] = str(e)
    res["used"] = engine.pool.used
    phase.end()
    return res


def routing_body(rank, world_size, hf_dir: str):
    """The toy loop (turns with observations between them) over a MoE model's native engine
    recording its routing: each trajectory's routed_experts against a teacher-forced forward
    (tests/rollout/moe_engine_bodies.routing_errors), observations -1."""
    from tests.rollout.moe_engine_bodies import routing_errors
    from verl_mcore.agent.runtime import AgentRuntime
    from verl_mcore.config import Config
    from verl_mcore.generation import GenerationPhase
    from verl_mcore.rollout import token_fields
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.user_code import load_user_object

    groups = setup(1, 1)
    arch, model = generation_model(hf_dir, groups, 1, 1)
    engine = NativeEngine(model, vocab_size=arch.vocab_size, block_size=4, max_num_seqs=16,
                          steps_per_sync=2, record_routing=True)
    phase = GenerationPhase(engine, None, groups, Config.load(None, []).rollout, (), 32, 0)
    prompts = _Prompts(LONG_PROMPTS[:3])
    runtime = AgentRuntime(load_user_object(TOY, "ToyLoop", "rollout.agent_loop"), {"turns": 3},
                           TOY, "ToyLoop", max_turns=8, tokenizer=None, eos_token_ids=[],
                           vocab_size=arch.vocab_size)
    token_fields.declare(token_fields.routing_field(arch.num_layers, arch.moe.topk))
    try:
        phase.begin(0)
        outs = runtime(phase, prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=32,
                                                      seed=5, logprobs=True))
    finally:
        token_fields.retract("routed_experts")
    bad, shapes = routing_errors(model, engine, [(prompts.input_ids[o.prompt_index], o)
                                                 for o in outs])
    return {"bad": bad, "shapes": sorted(shapes), "turns": [o.turns for o in outs],
            "observed": sum(o.loss_mask.count(0) for o in outs)}
