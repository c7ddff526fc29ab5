"""Rank bodies of the serving tests (rollout/serving.py over the native engine; module level:
spawn pickles them by name)."""
from __future__ import annotations

from tests.rollout.engine_bodies import LONG_NEW, LONG_PROMPTS, generation_model, setup


def _out(o):
    return (o.prompt_index, o.sample_index, o.token_ids, o.logprobs, o.finish_reason)


def serving_body(rank, world_size, hf_dir: str, tp_gen: int):
    """generate() against the same sequences served with staggered arrivals; a session's second
    turn over its kept KV; kept KV evicted under a tight pool."""
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.serving import Request, stream_key

    groups = setup(tp_gen, tp_gen)
    arch, model = generation_model(hf_dir, groups, tp_gen, tp_gen)

    def engine(**kw):
        return NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp, block_size=4, **kw)

    res = {}
    max_len = max(map(len, LONG_PROMPTS)) + LONG_NEW
    for name, sp in (("greedy", SamplingParams(n=2, temperature=0.0, max_new_tokens=LONG_NEW, logprobs=True)),
                     ("sampled", SamplingParams(n=2, temperature=1.0, max_new_tokens=LONG_NEW, seed=11,
                                                logprobs=True, stop_token_ids=list(range(0, arch.vocab_size, 9))))):
        eng = engine(max_num_seqs=3, steps_per_sync=2)
        res[f"{name}_generate"] = [_out(o) for o in eng.generate(LONG_PROMPTS, sp)]
        # The same sequences, arriving two at a time every other round, in reverse order; the
        # first pair with their own (shorter) budgets.
        reqs = [Request(p, key=stream_key(sp.seed or 0, i, j), share=i, prompt_index=i, sample_index=j)
                for i, p in enumerate(LONG_PROMPTS) for j in range(sp.n)][::-1]
        reqs[0] = Request(reqs[0].token_ids, key=reqs[0].key, max_new_tokens=3, prompt_index=reqs[0].prompt_index,
                          sample_index=reqs[0].sample_index)
        got, live, rounds = {}, [], 0
        with eng.serving(sp, max_len=max_len, sessions=len(reqs)) as server:
            while reqs or server.busy:
                if reqs and rounds % 2 == 0:
                    for r in reqs[:2]:
                        server.submit(r)
                    reqs = reqs[2:]
                for rid, o in server.step():
                    got[rid] = _out(o)
                live.append(len(server.st.live))
                rounds += 1
            res[f"{name}_serve_stats"] = {k: v for k, v in server.stats().items() if k != "rollout/seconds"}
        res[f"{name}_served"] = got
        res[f"{name}_live"] = live
        res[f"{name}_used"] = eng.pool.used

    # Two turns of one session: the second's context is the first's, its tokens and an
    # observation; only the tokens after the kept prefix are prefilled.
    sp = SamplingParams(temperature=0.0, max_new_tokens=5, logprobs=True)
    eng = engine(max_num_seqs=4)
    prompt, observation = LONG_PROMPTS[0], [3, 4, 5, 6, 7, 8, 9]
    with eng.serving(sp, max_len=64, sessions=2) as server:
        server.submit(Request(prompt, session="a"))
        [(_, first)] = _drain(server)
        before = server.stats()
        second = prompt + first.token_ids + observation
        server.submit(Request(second, session="a"))
        [(_, cont)] = _drain(server)
        after = server.stats()
        res["turns"] = (first.token_ids, cont.token_ids, cont.logprobs)
        res["turn_prefill"] = after["rollout/prefill_tokens"] - before["rollout/prefill_tokens"]
        res["turn_reused"] = after["rollout/kv_reused_tokens"]
        res["kept_before_release"] = after["rollout/kv_kept_sessions"]
        server.release("a")
        res["used_after_release"] = eng.pool.used
    # The same second turn recomputed from scratch: the same tokens.
    res["recomputed"] = [_out(o) for o in eng.generate([second], sp)]

    # A pool of 9 blocks (8 usable, 4 tokens each): three sessions' kept KV cannot all stay
    # while the next turns run; the oldest are evicted and recomputed, with the same tokens.
    tight = engine(max_num_seqs=2)
    tight._blocks_that_fit = lambda: 9
    roomy = engine(max_num_seqs=2)
    turns = {}
    for name, eng in (("tight", tight), ("roomy", roomy)):
        with eng.serving(sp, max_len=24, sessions=3) as server:
            firsts = {}
            for i in range(3):
                server.submit(Request(LONG_PROMPTS[3] + [i + 20], session=i, prompt_index=i))
            for _, o in _drain(server):
                firsts[o.prompt_index] = o.token_ids
            for i in range(3):
                server.submit(Request(LONG_PROMPTS[3] + [i + 20] + firsts[i] + [7, 7], session=i, prompt_index=i))
            seconds = {o.prompt_index: o.token_ids for _, o in _drain(server)}
            turns[name] = (firsts, seconds, server.stats()["rollout/kv_kept_evictions"])
        turns[name + "_used"] = eng.pool.used
    res["evict"] = turns
    return res


def _drain(server):
    done = []
    while server.busy:
        done += server.step()
    return done
