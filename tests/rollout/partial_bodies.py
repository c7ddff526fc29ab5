"""Rank bodies of the native engine's abort tests (tests/rollout/test_partial_native.py; module
level: spawn pickles them by name)."""
from __future__ import annotations

from tests.rollout.engine_bodies import LONG_NEW, LONG_PROMPTS, generation_model, setup


def abort_body(rank, world_size, hf_dir: str, tp_gen: int):
    """generate()'s samples; the same requests served two rounds, aborted, and continued from
    their tokens (key, draws = tokens so far); a PartialPool over the engine, three steps of the
    same weights."""
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.partial import PartialPool
    from verl_mcore.rollout.serving import Request, stream_key

    groups = setup(tp_gen, tp_gen)
    arch, model = generation_model(hf_dir, groups, tp_gen, tp_gen)
    eng = NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp, block_size=4,
                       max_num_seqs=3, steps_per_sync=2)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=LONG_NEW, seed=11, logprobs=True,
                        stop_token_ids=list(range(0, arch.vocab_size, 9)))
    res = {"generate": {(o.prompt_index, o.sample_index): (o.token_ids, o.logprobs, o.finish_reason)
                        for o in eng.generate(LONG_PROMPTS, sp)}}
    max_len = max(map(len, LONG_PROMPTS)) + LONG_NEW
    requests = [Request(p, key=stream_key(sp.seed, i, j), prompt_index=i, sample_index=j)
                for i, p in enumerate(LONG_PROMPTS) for j in range(sp.n)]
    finished, aborted = {}, {}
    with eng.serving(sp, max_len=max_len, sessions=len(requests)) as server:
        for r in requests:
            server.submit(r)
        for _ in range(2):
            for rid, o in server.step():
                finished[rid] = (o.token_ids, o.finish_reason)
        for rid, o in server.abort():
            aborted[rid] = (o.token_ids, o.logprobs, o.finish_reason)
        res["busy_after_abort"] = server.busy
        res["used_after_abort"] = eng.pool.used
        # Each aborted sample continued from its tokens, in the same session.
        continued = {}
        for rid, (toks, _, _) in aborted.items():
            r = requests[rid]
            cid = server.submit(Request(list(r.token_ids) + toks, key=r.key, draws=len(toks),
                                        max_new_tokens=LONG_NEW - len(toks), prompt_index=r.prompt_index,
                                        sample_index=r.sample_index))
            continued[cid] = rid
        while server.busy:
            for cid, o in server.step():
                rid = continued[cid]
                finished[rid] = (aborted[rid][0] + o.token_ids, o.finish_reason)
    res["finished"] = {(requests[rid].prompt_index, requests[rid].sample_index): v
                       for rid, v in finished.items()}
    res["aborted"] = {(requests[rid].prompt_index, requests[rid].sample_index): v
                      for rid, v in aborted.items()}
    res["used_at_end"] = eng.pool.used

    # The pool over the engine, one group needed a step, the same weights each step (versions
    # 0, 1, 2): every taken sample is generate()'s, whatever step it was interrupted at.
    pool = PartialPool(n=2, max_new_tokens=LONG_NEW, max_staleness=2, in_flight=2, logprobs=True)
    for i, p in enumerate(LONG_PROMPTS):
        pool.add(i, p, None, [stream_key(sp.seed, i, j) for j in range(sp.n)])
    taken = []
    for version in range(len(LONG_PROMPTS)):
        with eng.serving(sp, max_len=max_len, sessions=4) as server:
            step = pool.run(server, need=1, version=version)
        taken += [(g.serial, [(s.tokens, s.versions, s.finish) for s in g.samples], step.counts)
                  for g in step.taken]
    res["pool"] = taken
    return res
