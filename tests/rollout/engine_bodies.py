"""Rank bodies and helpers for the rollout engine tests (module level: spawn pickles them by name)."""
from __future__ import annotations

import torch

# Prompts of different lengths; more of them than the engine's slots, so finished slots refill.
PROMPTS = [[5, 17, 42, 99, 7], [3, 200, 11], [150, 151, 152, 153, 154, 155, 9], [77], [12, 240, 8, 31]]
MAX_NEW = 8
SAMPLED_CUTS = {"sampled_t1": {}, "sampled_top_k": {"top_k": 20}, "sampled_top_p": {"top_p": 0.9}}


def hf_greedy(hf_dir: str, prompts, max_new: int):
    """transformers' greedy continuation (fp32, one prompt at a time: no padding) and the
    log-probs of the chosen tokens."""
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens, logps = [], []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
            new = out.sequences[0, len(p):].tolist()
            lp = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, new)]
            tokens.append(new)
            logps.append(lp)
    return tokens, logps


def setup(tp: int, tp_gen: int, pp: int = 1):
    from verl_mcore.config import Config
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups

    cpu_compat.install()
    torch.manual_seed(0)
    cfg = Config.load(None, [f"parallel.tensor_model_parallel_size={tp}",
                             f"parallel.pipeline_model_parallel_size={pp}",
                             f"rollout.tensor_parallel_size={tp_gen}"])
    return build_groups(cfg)


def generation_model(hf_dir: str, groups, tp_gen: int, tp_train: int, load: bool = True,
                     divisible_by: int = 128):
    """The TP_g generation-layout GPTModel (fp32), with the padded vocabulary of a training model
    at TP = tp_train (build.padded_vocab)."""
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import read_hf_arch, transformer_config
    from verl_mcore.models.hf_weights import load_hf_weights

    arch = read_hf_arch(hf_dir)
    model = build_gpt_model(arch, transformer_config(arch, tp=tp_gen, dtype="fp32"), role="actor",
                            pg_collection=groups.gen,
                            padded_vocab=arch.padded_vocab_size(tp_train, divisible_by))
    if load:
        load_hf_weights(model, arch, hf_dir, role="actor")
    return arch, model


def engine_body(rank, world_size, hf_dir: str, tp_gen: int, fused: bool = False):
    """Greedy, seeded sampling, n > 1, stop tokens, max length and sleep/wake on a TP_g engine.
    fused: decode through the fused-decode path (on CPU its ops run their torch references)."""
    from verl_mcore.rollout import native

    if not fused:
        return _engine_body(rank, tp_gen, hf_dir)
    supported = native._CachedGPT.fused_decode_supported
    native._CachedGPT.fused_decode_supported = lambda self: None
    try:  # the ranks are pooled processes: restore the class for the next task
        res = _engine_body(rank, tp_gen, hf_dir)
        res["fused"] = True
        return res
    finally:
        native._CachedGPT.fused_decode_supported = supported


def _engine_body(rank, tp_gen: int, hf_dir: str):
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    groups = setup(tp_gen, tp_gen)
    arch, model = generation_model(hf_dir, groups, tp_gen, tp_gen)
    engine = NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp, max_num_seqs=3)
    res = {"fused_engine": engine.fused, "plain_swiglu": engine.net.plain_swiglu}

    def run(sp, eng=engine):
        return [(o.prompt_index, o.sample_index, o.token_ids, o.logprobs, o.finish_reason)
                for o in eng.generate(PROMPTS, sp)]

    res["greedy"] = run(SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, logprobs=True))
    # n = 2 greedy: the second sample decodes from the copied prompt cache. A prefill budget
    # below the prompt lengths admits one prompt per round.
    res["greedy_n2"] = run(SamplingParams(n=2, temperature=0.0, max_new_tokens=MAX_NEW),
                           NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp,
                                        max_num_seqs=4, max_prefill_tokens=4))
    # The prefill budget counts padded tokens (prompts x the longest): prompts of 5, 3, 7, 1, 4
    # tokens under a budget of 10 go in as [5, 3], [7], [1, 4].
    budgeted = NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp, max_num_seqs=8,
                            max_prefill_tokens=10)
    padded, prefill = [], budgeted._prefill
    budgeted._prefill = lambda ps, slots: (padded.append([len(p) for p in ps]), prefill(ps, slots))[1]
    res["greedy_budgeted"] = run(SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), budgeted)
    res["prefill_rounds"] = padded
    sampled = SamplingParams(n=3, temperature=0.9, top_p=0.95, top_k=40, max_new_tokens=6, seed=7,
                             logprobs=True)
    res["sampled"] = run(sampled)
    res["sampled_again"] = run(sampled)
    res["sampled_other_seed"] = run(SamplingParams(n=3, temperature=0.9, top_p=0.95, top_k=40,
                                                   max_new_tokens=6, seed=8))
    # Batch invariance: more slots (other batching and slot order) give the same samples.
    wide = NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp, max_num_seqs=16)
    res["sampled_wide"] = run(sampled, wide)
    # Each path of the sampler at temperature 1: the vocabulary-order CDF, top-k, top-p alone
    # (test_native_engine compares them, and "sampled", between TP_g = 1 and 2).
    for name, cut in SAMPLED_CUTS.items():
        res[name] = run(SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3,
                                       logprobs=True, **cut))
    # Stop tokens: the fourth greedy token of prompt 0 and the last of prompt 1.
    greedy = {o[0]: o[2] for o in res["greedy"]}
    stops = (greedy[0][3], greedy[1][-1])
    res["stops"] = stops
    res["stopped"] = run(SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, stop_token_ids=stops))
    res["stopped_stats"] = {k: v for k, v in engine.last_stats.items()  # the same on every rank
                            if k != "rollout/seconds"}
    res["short"] = run(SamplingParams(temperature=0.0, max_new_tokens=1))
    # sleep releases the KV cache; the next call re-allocates it and gives the same tokens.
    engine.sleep()
    res["cache_after_sleep"] = engine.cache is None
    engine.wake()
    res["greedy_after_wake"] = run(SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    if tp_gen > 1:
        # A training model built with sequence parallelism serves generation as it is (TP_g =
        # TP_t). Without TransformerEngine megatron refuses to build one (torch norms), so set
        # the flags megatron would have set; the engine must switch them off and restore them.
        from verl_mcore.rollout.native import _SP_FLAGS

        flagged = [(m, f) for m in list(model.modules()) + [model.config] for f in _SP_FLAGS
                   if hasattr(m, f) and not callable(getattr(m, f))]
        for m, f in flagged:
            setattr(m, f, True)
        res["greedy_sequence_parallel"] = run(
            SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW),
            NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp))
        res["sequence_parallel_flags"] = len(flagged)
        res["sequence_parallel_restored"] = all(getattr(m, f) is True for m, f in flagged)
        # One rank has room for fewer KV blocks (less free GPU memory): the group agrees on the
        # smallest, so both ranks run the same schedule; room for none: both refuse.
        tight = NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp, max_num_seqs=8)
        if rank == 1:
            tight._blocks_that_fit = lambda: 3  # the scratch block and two more
        res["agreed_slots_n2"] = run(SamplingParams(n=2, temperature=0.0, max_new_tokens=MAX_NEW), tight)
        res["agreed_slots"] = tight.last_stats["rollout/kv_blocks"]
        res["agreed_peak_live"] = tight.last_stats["rollout/peak_live_sequences"]
        starved = NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp)
        if rank == 0:
            starved._blocks_that_fit = lambda: 0
        try:
            run(SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), starved)
            res["starved_error"] = None
        except RuntimeError as e:
            res["starved_error"] = "KV cache" in str(e)
        # Different prompts on the ranks of one group: an error on every rank, not a hang.
        try:
            engine.generate(PROMPTS if rank == 0 else PROMPTS[:2], SamplingParams())
            res["mismatch_error"] = None
        except ValueError as e:
            res["mismatch_error"] = "different prompts" in str(e)
        # ... also when only one rank's prompts are invalid (checked before the validation).
        try:
            engine.generate(PROMPTS if rank == 0 else [[]], SamplingParams())
            res["mismatch_invalid_error"] = None
        except ValueError as e:
            res["mismatch_invalid_error"] = "different prompts" in str(e)
    return res


def sync_body(rank, world_size, hf_dir: str, tp_train: int, tp_gen: int):
    """Training model at TP_t -> repartition -> engine at TP_g; the weight-sync check passes, and
    fires once one generation weight is corrupted."""
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import transformer_config
    from verl_mcore.models.hf_weights import load_hf_weights
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.repartition import Repartitioner
    from verl_mcore.rollout.sync_check import WeightSyncError, check_weight_sync, model_logprobs_fn

    groups = setup(tp_train, tp_gen)
    arch, gen = generation_model(hf_dir, groups, tp_gen, tp_train, load=False)
    train = build_gpt_model(arch, transformer_config(arch, tp=tp_train, dtype="fp32"), role="actor")
    load_hf_weights(train, arch, hf_dir, role="actor")
    rep = Repartitioner([train], gen, groups, gated_linear_unit=True)
    from verl_mcore.config import Config

    rollout_cfg = Config.load(None, ["rollout.max_num_seqs=4"]).rollout
    engine = NativeEngine.from_config(rollout_cfg, gen, vocab_size=arch.vocab_size, groups=groups,
                                      repartitioner=rep)
    res = {"load": engine.load_weights(), "slots": engine.max_num_seqs}
    trainer = model_logprobs_fn(train, arch.vocab_size, groups.train.tp)
    # Each generation replica checks its own prompts (as in training).
    prompts = PROMPTS[groups.gen_dp_rank::groups.layout.dp_gen]
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=groups.gen_dp_rank, logprobs=True)
    res["ok"] = check_weight_sync(engine.generate(prompts, sp), prompts, trainer, sp.temperature,
                                  max_abs_diff=1e-3)
    res["greedy"] = [o.token_ids for o in engine.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))]
    # sleep releases the weight buffer too; wake + load_weights brings the same weights back.
    engine.sleep()
    res["buffer_released"] = rep.buffer.buffer.untyped_storage().size() == 0
    engine.wake()
    engine.load_weights()
    res["greedy_after_wake"] = [o.token_ids for o in engine.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))]
    # A broken sync: one weight of one layer is off on one rank's generation copy.
    with torch.no_grad():
        if rank == 0:
            gen.decoder.layers[1].mlp.linear_fc2.weight.mul_(3.0)
    try:
        check_weight_sync(engine.generate(prompts, sp), prompts, trainer, sp.temperature,
                          max_abs_diff=1e-3)
        res["corrupt"] = None
    except WeightSyncError as e:
        res["corrupt"] = str(e)
    return res


def _lm_head(model) -> torch.Tensor:
    """The LM head's weight of a GPTModel holding every layer (the embedding when tied)."""
    head = model.output_layer.weight
    return head if head is not None else model.embedding.word_embeddings.weight


def _global_max(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def padding_body(rank, world_size, hf_dir: str, tp_train: int, tp_gen: int, divisible_by: int):
    """Huge logits on the padding ids (LM-head rows >= the real vocabulary, randomly large, so at
    every position some padding id has by far the largest logit): the engine's samples and
    log-probs and the trainer's log-probs of the sync check are those of the clean model."""
    from verl_mcore.config import Config
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import transformer_config
    from verl_mcore.models.hf_weights import load_hf_weights
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.repartition import Repartitioner
    from verl_mcore.rollout.sync_check import check_weight_sync, model_logprobs_fn

    groups = setup(tp_train, tp_gen)
    arch, gen = generation_model(hf_dir, groups, tp_gen, tp_train, load=False,
                                 divisible_by=divisible_by)
    train = build_gpt_model(arch, transformer_config(arch, tp=tp_train, dtype="fp32"), role="actor",
                            vocab_divisible_by=divisible_by)
    load_hf_weights(train, arch, hf_dir, role="actor")
    rollout_cfg = Config.load(None, ["rollout.max_num_seqs=4"]).rollout
    engine = NativeEngine.from_config(rollout_cfg, gen, vocab_size=arch.vocab_size, groups=groups,
                                      repartitioner=Repartitioner([train], gen, groups, True))
    trainer = model_logprobs_fn(train, arch.vocab_size, groups.train.tp)
    prompts = PROMPTS[groups.gen_dp_rank::groups.layout.dp_gen]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, logprobs=True)
    sampled = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=5, logprobs=True)

    def run():
        engine.load_weights()
        out = {}
        for name, sp in (("greedy", greedy), ("sampled", sampled)):
            outs = engine.generate(PROMPTS, sp)
            out[name] = [o.token_ids for o in outs]
            out[name + "_logp"] = [o.logprobs for o in outs]
            theirs = trainer([PROMPTS[o.prompt_index] for o in outs], [o.token_ids for o in outs],
                             sp.temperature)
            out[name + "_trainer"] = [t.tolist() for t in theirs]
        out["check"] = check_weight_sync(engine.generate(prompts, sampled), prompts, trainer,
                                         sampled.temperature, max_abs_diff=1e-4)
        return out

    res = {"vocab": arch.vocab_size, "padded": train.vocab_size, "clean": run()}
    head = _lm_head(train)  # this TP_t rank's rows [start, start + rows) of the padded head
    rows = head.shape[0]
    start = groups.train.tp.rank() * rows
    # The same poison on every rank, sliced per shard: rows in +/- pairs, so at any position one
    # row of each pair has a logit of 1e3 * |h . r| > 0.
    g = torch.Generator().manual_seed(11)
    pairs = torch.randn(-(-(train.vocab_size - arch.vocab_size) // 2), head.shape[1], generator=g)
    poison = torch.stack([pairs, -pairs], dim=1).flatten(0, 1) * 1e3
    lo = max(arch.vocab_size, start)
    with torch.no_grad():
        if lo < start + rows:
            head[lo - start:] = poison[lo - arch.vocab_size: start + rows - arch.vocab_size]
        # The poison is real: at every position of every prompt a padding id has the top logit.
        tokens = torch.tensor([PROMPTS[0]])
        logits = train(tokens, torch.arange(tokens.shape[1])[None], None)[0]  # [s, V_local]
        ids = torch.arange(start, start + rows)
        real = _global_max(logits.masked_fill(ids >= arch.vocab_size, float("-inf")).amax(-1),
                           groups.train.tp)
        pad = _global_max(logits.masked_fill(ids < arch.vocab_size, float("-inf")).amax(-1),
                          groups.train.tp)
    res["poison_margin"] = (pad - real).min().item()
    res["poisoned"] = run()
    return res


# Longer prompts (several 4-token blocks each; two share their first 8 tokens) for the paged cache.
LONG_PROMPTS = [[5, 17, 42, 99, 7, 61, 33, 2, 90, 14, 71], [3, 200, 11, 9, 18, 27, 36, 45],
                [150, 151, 152, 153, 154, 155, 9, 8, 7, 6, 5, 4, 3], [77, 78]]
LONG_NEW = 10


def paged_body(rank, world_size, hf_dir: str, tp_gen: int, fused: bool = False):
    """The paged KV cache with 4-token blocks: greedy and seeded tokens through every decode
    round length, prefix sharing, preemption (a pool too small for the live sequences), and
    the blocks all returned afterwards."""
    from verl_mcore.rollout import native
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    groups = setup(tp_gen, tp_gen)
    arch, model = generation_model(hf_dir, groups, tp_gen, tp_gen)
    supported = native._CachedGPT.fused_decode_supported
    if fused:
        native._CachedGPT.fused_decode_supported = lambda self: None
    res = {}
    try:
        def engine(**kw):
            return NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp,
                                block_size=4, **kw)

        def run(eng, sp, prompts=LONG_PROMPTS):
            out = [(o.prompt_index, o.sample_index, o.token_ids, o.logprobs, o.finish_reason)
                   for o in eng.generate(prompts, sp)]
            stats = {k: v for k, v in eng.last_stats.items() if k != "rollout/seconds"}
            return out, stats, eng.pool.used

        greedy = SamplingParams(temperature=0.0, max_new_tokens=LONG_NEW, logprobs=True)
        for k in (1, 3, 16):
            res[f"greedy_k{k}"] = run(engine(max_num_seqs=3, steps_per_sync=k), greedy)
        sampled = SamplingParams(n=4, temperature=1.0, max_new_tokens=LONG_NEW, seed=11, logprobs=True)
        res["sampled"] = run(engine(max_num_seqs=16), sampled)
        res["sampled_k1"] = run(engine(max_num_seqs=5, steps_per_sync=1), sampled)
        # 13 blocks of 4 tokens (12 besides the scratch block) hold two or three of these
        # 20-token sequences: the live ones outgrow the pool and the newest are preempted.
        tight = engine(max_num_seqs=16, steps_per_sync=2)
        tight._blocks_that_fit = lambda: 13
        res["greedy_n4_tight"] = run(tight, SamplingParams(n=4, temperature=0.0, max_new_tokens=LONG_NEW))
        res["greedy_n4"] = run(engine(max_num_seqs=16), SamplingParams(n=4, temperature=0.0,
                                                                       max_new_tokens=LONG_NEW))
        res["sampled_tight"] = run(tight, sampled)
        # responses ending at varied lengths, stepped over every slot or compacted into fewer
        varied = SamplingParams(n=4, temperature=1.0, max_new_tokens=LONG_NEW, seed=7, logprobs=True,
                                stop_token_ids=list(range(0, arch.vocab_size, 4)))
        res["varied"] = run(engine(max_num_seqs=16, steps_per_sync=2, min_compact_slots=0), varied)
        res["varied_compact"] = run(engine(max_num_seqs=16, steps_per_sync=2, min_compact_slots=1), varied)
        from bench.bench_rollout import stage_breakdown  # the bench's stages are the engine's methods

        res["breakdown"] = stage_breakdown(tight, lambda: tight.generate(LONG_PROMPTS, sampled))
    finally:
        native._CachedGPT.fused_decode_supported = supported
    return res


def paged_edge_body(rank, world_size, hf_dir: str, tp_gen: int):
    """Edges of the paged cache on LONG_PROMPTS (11, 8, 13, 2 tokens: whole blocks of 1 and 2
    tokens, one less or one more than whole 3-token blocks): blocks of 1 and 3 tokens under
    rounds longer than a block; one new token (3 samples sharing prompt blocks); a stop token
    as the very first sampled token; a pool that holds one sequence at a time, so samples whose
    prompt blocks live siblings still hold are preempted; that engine called again with other
    prompts and settings. Each run reports whether every block and reference came back. Only
    the last rank is short of blocks (under TP_g = 2 the group agrees on its count)."""
    from verl_mcore.rollout import native
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    groups = setup(tp_gen, tp_gen)
    arch, model = generation_model(hf_dir, groups, tp_gen, tp_gen)

    def engine(**kw):
        return NativeEngine(model, vocab_size=arch.vocab_size, tp_group=groups.gen_tp, **kw)

    def run(eng, sp, prompts=LONG_PROMPTS):
        out = [(o.prompt_index, o.sample_index, o.token_ids, o.logprobs, o.finish_reason)
               for o in eng.generate(prompts, sp)]
        stats = {k: v for k, v in eng.last_stats.items() if k != "rollout/seconds"}
        return out, stats, eng.pool.used == 0 and not eng.pool.refs.any()

    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=LONG_NEW, logprobs=True)
    res = {f"greedy_bs{bs}": run(engine(block_size=bs, max_num_seqs=3, steps_per_sync=5), greedy)
           for bs in (1, 3)}
    res["one_token"] = run(engine(block_size=3, max_num_seqs=16, steps_per_sync=4),
                           SamplingParams(n=3, temperature=0.0, max_new_tokens=1))
    res["stops"] = (res["greedy_bs1"][0][0][2][0],)  # prompt 0's first greedy token
    res["stop_first"] = run(engine(block_size=3, max_num_seqs=16, steps_per_sync=4), SamplingParams(
        n=2, temperature=0.0, max_new_tokens=LONG_NEW, stop_token_ids=res["stops"]))
    # 8 blocks of 3 tokens besides the scratch block: one sequence of 13 + 10 tokens.
    tight = engine(block_size=3, max_num_seqs=16, steps_per_sync=2)
    if rank == world_size - 1:
        tight._blocks_that_fit = lambda: 9
    shared_preempted = []
    preempt = native._Schedule.preempt

    def counting_preempt(st, slot):
        shared_preempted.append(any(st.pool.refs[b] > 1 for b in st.blocks[slot]))
        preempt(st, slot)

    native._Schedule.preempt = counting_preempt
    try:  # the ranks are pooled processes: restore the class for the next task
        res["tight_greedy"] = run(tight, SamplingParams(n=4, temperature=0.0, max_new_tokens=LONG_NEW))
        sampled = SamplingParams(n=4, temperature=1.0, max_new_tokens=LONG_NEW, seed=11, logprobs=True)
        res["tight_sampled"] = run(tight, sampled)
        res["shared_preempted"] = sum(shared_preempted)
        # The same engine again: shorter calls (another table width), then the first again.
        res["again_short"] = run(tight, SamplingParams(temperature=0.0, max_new_tokens=4),
                                 LONG_PROMPTS[::-1])
        res["again_sampled"] = run(tight, sampled)
    finally:
        native._Schedule.preempt = preempt
    for name, kw in (("block_size", dict(block_size=0)), ("max_num_seqs", dict(max_num_seqs=0))):
        try:
            engine(**kw)
            res[f"bad_{name}"] = None
        except ValueError as e:
            res[f"bad_{name}"] = str(e)
    return res


def triton_engine_body(rank, world_size, hf_dir: str):
    """The engine with its decode attention forced to ops/triton_paged.py under Triton's CPU
    interpreter (fp32), over 4-token blocks: greedy tokens and log-probs, then seeded samples with
    prefix sharing and preemption, beside the same calls with the reference attention."""
    from tests.triton_interpret import use_interpreter

    use_interpreter()
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    groups = setup(1, 1)
    arch, model = generation_model(hf_dir, groups, 1, 1)
    mode = NativeEngine._attention_mode
    res = {}
    try:
        for name, forced in (("triton", ("triton", "forced: the interpreter on the CPU")), ("reference", (None, "forced"))):
            NativeEngine._attention_mode = lambda self, forced=forced: forced
            def run(eng, sp):
                out = [(o.prompt_index, o.sample_index, o.token_ids, o.logprobs) for o in eng.generate(LONG_PROMPTS, sp)]
                return out, eng.last_stats, eng.pool.used, eng.attention
            greedy = SamplingParams(temperature=0.0, max_new_tokens=LONG_NEW, logprobs=True)
            res[name + "_greedy"] = run(NativeEngine(model, vocab_size=arch.vocab_size, block_size=4,
                                                     max_num_seqs=3, steps_per_sync=3), greedy)
            tight = NativeEngine(model, vocab_size=arch.vocab_size, block_size=4, max_num_seqs=16, steps_per_sync=2)
            tight._blocks_that_fit = lambda: 13
            # first a call of one sample a prompt on the same 16 slots (a decode state of the same
            # shape, without prefix groups): the n = 4 call must still get its own, with them
            tight.generate(LONG_PROMPTS * 4, SamplingParams(temperature=1.0, max_new_tokens=LONG_NEW, seed=3,
                                                            logprobs=True))
            res[name + "_sampled"] = run(tight, SamplingParams(n=4, temperature=1.0, max_new_tokens=LONG_NEW,
                                                               seed=3, logprobs=True))
    finally:
        NativeEngine._attention_mode = mode
    return res


def kept_cache_body(rank, world_size, hf_dir: str):
    """sleep() under keep_cache_bytes: the cache and the decode states stay for the next call,
    whose samples equal a fresh engine's; under a smaller budget, or once the weights moved,
    they go."""
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    groups = setup(1, 1)
    arch, model = generation_model(hf_dir, groups, 1, 1)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=3, logprobs=True)

    def run(eng):
        return [(o.token_ids, o.logprobs) for o in eng.generate(PROMPTS, sp)]

    fresh = run(NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=4))
    engine = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=4)
    res = {"first": run(engine) == fresh}
    cache, states = engine.cache, dict(engine._graphs)
    engine.keep_cache_bytes = engine.cache_bytes
    engine.sleep()
    res["kept_bytes"], res["cache_bytes"] = engine.kept_bytes, cache.numel() * cache.element_size()
    engine.wake()
    res["kept_again"] = run(engine) == fresh
    res["same_cache"] = engine.cache is cache
    res["same_states"] = all(engine._graphs.get(k) is v for k, v in states.items()) and bool(states)
    # The weights move (a storage freed and restored elsewhere): the decode states go with them.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    res["after_move"] = run(engine) == fresh
    res["states_renewed"] = not any(engine._graphs.get(k) is v for k, v in states.items())
    engine.keep_cache_bytes = engine.cache_bytes - 1
    engine.sleep()
    res["freed"] = engine.cache is None and engine.kept_bytes == 0 and not engine._graphs
    return res
