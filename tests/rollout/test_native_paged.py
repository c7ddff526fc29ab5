"""The native engine's paged KV cache (rollout/kv_blocks.py) on CPU gloo ranks: blocks of 4
tokens, so every sequence spans several; against transformers' greedy generate."""
import pytest

from tests.multiproc import run_on_ranks
from tests.rollout import engine_bodies as eb
from verl_mcore.rollout.kv_blocks import BlockPool, OutOfBlocks


@pytest.fixture(scope="module")
def paged_model(tmp_path_factory):
    from tests.models.hf_factory import save_tiny_model

    hf_dir = save_tiny_model("qwen2", str(tmp_path_factory.mktemp("paged") / "qwen2"), seed=5)
    return (hf_dir, *eb.hf_greedy(hf_dir, eb.LONG_PROMPTS, eb.LONG_NEW))


@pytest.fixture(scope="module")
def paged(paged_model):
    hf_dir, tokens, logps = paged_model
    [res] = run_on_ranks(eb.paged_body, 1, args=(hf_dir, 1), timeout=240)
    return res, tokens, logps


@pytest.mark.distributed
def test_paged_greedy_equals_transformers_for_every_round_length(paged):
    res, tokens, logps = paged
    for k in (1, 3, 16):
        out, stats, used = res[f"greedy_k{k}"]
        assert [o[2] for o in out] == tokens, k
        assert max(abs(a - b) for o, ref in zip(out, logps) for a, b in zip(o[3], ref)) < 1e-4
        assert used == 0  # every block back in the pool
        # A round of k steps between host syncs: the longest sequence's 9 decode steps take
        # ceil(9 / k) rounds per admission wave.
        assert stats["rollout/host_syncs"] >= -(-(eb.LONG_NEW - 1) // k)


@pytest.mark.distributed
def test_paged_prefix_sharing_and_batch_invariance(paged):
    res, _, _ = paged
    out, stats, used = res["sampled"]
    # 4 samples of each prompt, admitted together: the prompts' full blocks (11 // 4 + 8 // 4 +
    # 13 // 4 + 0 = 7) are held by 3 more samples each.
    assert stats["rollout/kv_shared_prefix_blocks"] == 7 * 3
    assert used == 0
    assert len({tuple(o[2]) for o in out}) > len(eb.LONG_PROMPTS)
    # Other slot counts and round lengths: the same samples (the random stream is per sequence
    # and step), log-probs equal up to float rounding.
    other, _, _ = res["sampled_k1"]
    assert [o[:3] for o in other] == [o[:3] for o in out]
    assert max(abs(a - b) for x, y in zip(other, out) for a, b in zip(x[3], y[3])) < 1e-5


@pytest.mark.distributed
def test_bench_breakdown_times_the_engines_stages(paged):
    """bench_rollout --breakdown wraps the engine's stage methods: a renamed one fails here."""
    seconds = paged[0]["breakdown"]
    stages = ["admit (prefill + first sample)", "decode steps", "grow (blocks, preemption)",
              "collect (host sync)", "host", "total"]
    assert list(seconds) == stages
    assert all(seconds[k] > 0 for k in stages[:4]) and abs(sum(seconds.values()) - 2 * seconds["total"]) < 1e-9


@pytest.mark.distributed
def test_paged_preemption_recomputes_the_same_tokens(paged):
    res, tokens, _ = paged
    out, stats, used = res["greedy_n4_tight"]
    assert stats["rollout/preemptions"] > 0 and stats["rollout/kv_blocks"] == 12
    assert stats["rollout/kv_peak_blocks_used"] <= 12
    assert sorted((o[0], o[1], o[2]) for o in out) == sorted((o[0], o[1], o[2]) for o in res["greedy_n4"][0])
    assert [o[2] for o in out if o[1] == 0] == tokens
    assert used == 0
    # Seeded samples survive preemption: a recomputed sequence draws the same numbers.
    tight, tstats, _ = res["sampled_tight"]
    assert tstats["rollout/preemptions"] > 0
    assert [o[:3] for o in tight] == [o[:3] for o in res["sampled"][0]]



@pytest.mark.distributed
@pytest.mark.parametrize("tp_gen", [1, 2])
def test_paged_edges(paged_model, paged, tp_gen):
    """Block sizes 1 and 3, one new token, a stop as the first token, one sequence at a time
    (samples preempted while siblings hold their prompt blocks), one engine reused; TP_g = 2
    with only rank 1 short of blocks."""
    hf_dir, tokens, logps = paged_model
    results = run_on_ranks(eb.paged_edge_body, tp_gen, args=(hf_dir, tp_gen), timeout=240)
    res = results[0]
    for name in ("greedy_bs1", "greedy_bs3", "one_token", "stop_first", "tight_greedy",
                 "tight_sampled", "again_short", "again_sampled"):
        assert res[name][2], name  # every block back in the pool, every reference dropped
    for bs in (1, 3):
        out = res[f"greedy_bs{bs}"][0]
        assert [o[2] for o in out] == [t for t in tokens for _ in range(2)], bs
        assert max(abs(a - b) for o in out for a, b in zip(o[3], logps[o[0]])) < 1e-4
    assert [(o[2], o[4]) for o in res["one_token"][0]] == [(t[:1], "length") for t in tokens for _ in range(3)]
    [stop] = res["stops"]
    for o in res["stop_first"][0]:
        full = tokens[o[0]]
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert (o[2], o[4]) == (full[:cut], "stop" if stop in full else "length"), o
    assert res["stop_first"][0][0][2] == [stop]
    tight, stats, _ = res["tight_greedy"]
    assert stats["rollout/kv_blocks"] == 8 and stats["rollout/peak_live_sequences"] >= 1
    assert stats["rollout/preemptions"] > 0 and stats["rollout/kv_shared_prefix_blocks"] > 0
    assert [o[2] for o in tight] == [t for t in tokens for _ in range(4)]
    assert res["shared_preempted"] > 0
    # Seeded samples: those of the roomy 4-token-block engine, through preemption and reuse.
    roomy = paged[0]["sampled"][0]
    for name in ("tight_sampled", "again_sampled"):
        assert [o[:3] for o in res[name][0]] == [o[:3] for o in roomy], name
        assert max(abs(a - b) for x, y in zip(res[name][0], roomy) for a, b in zip(x[3], y[3])) < 1e-4
    assert [o[2] for o in res["again_short"][0]] == [t[:4] for t in tokens[::-1]]
    assert "block_size must be >= 1" in res["bad_block_size"]
    assert "max_num_seqs must be >= 1" in res["bad_max_num_seqs"]
    assert all(r == res for r in results)  # every TP rank: the same tokens, schedule and stats


def test_block_pool_counts_holders():
    pool = BlockPool(5, 4)
    assert pool.free == 4 and pool.blocks_for(9) == 3
    a = pool.take(3)
    assert 0 not in a and pool.used == 3
    pool.share(a[:2])
    pool.release(a)
    assert pool.free == 2 and pool.used == 2  # a[0], a[1] still held once
    pool.release(a[:2])
    assert pool.free == 4 and pool.peak_used == 3
    with pytest.raises(OutOfBlocks):
        pool.take(5)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(a[:1])


@pytest.mark.slow  # ~3.5 min: every Triton program of every step interpreted in Python
@pytest.mark.distributed
def test_engine_with_triton_paged_attention_in_the_interpreter(paged_model):
    """ops/triton_paged.py as the engine's decode attention (Triton's CPU interpreter, fp32,
    4-token blocks): transformers' greedy tokens, and the reference attention's seeded samples
    under prefix sharing (the shared blocks read once for the samples: cascade) and preemption,
    every block returned."""
    pytest.importorskip("triton", reason="Triton is not installed here (the GPU image has it)")
    hf_dir, tokens, logps = paged_model
    # fresh ranks: the interpreter patches triton.language while a kernel runs, so the kernels must
    # be built and run in a process of their own
    [res] = run_on_ranks(eb.triton_engine_body, 1, args=(hf_dir,), timeout=900, fresh=True)
    out, _, used, attention = res["triton_greedy"]
    assert attention == "triton" and used == 0
    assert [o[2] for o in out] == tokens
    assert max(abs(a - b) for o, ref in zip(out, logps) for a, b in zip(o[3], ref)) < 1e-4
    got, stats, used, _ = res["triton_sampled"]
    want, want_stats, _, attention = res["reference_sampled"]
    assert attention is None and used == 0
    assert stats["rollout/preemptions"] > 0 and stats["rollout/kv_shared_prefix_blocks"] > 0
    # the samples' shared prompt blocks read once a group (cascade), rounds with groups counted
    assert stats["rollout/prefix_group_rounds"] > 0 and want_stats["rollout/prefix_group_rounds"] == 0
    assert [o[:3] for o in got] == [o[:3] for o in want]
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x[3], y[3])) < 1e-4


def test_prefix_groups_are_the_samples_holding_a_prompts_blocks():
    """_Schedule.prefix_groups: decoding slots whose first block is shared, the leading blocks all
    of them hold, rows of at most n_max members; a slot alone, or not decoding, has none."""
    import numpy as np

    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import _Schedule

    pool = BlockPool(20, 4)
    st = _Schedule([[1] * 9, [2] * 5], SamplingParams(n=3, temperature=1.0, max_new_tokens=4), 6, 5, pool, 0)
    head = pool.take(3)  # prompt 0: 9 tokens, two full blocks and a partial one
    st.place(0, 0, head)
    for s, slot in ((1, 1), (2, 2)):
        pool.share(head[:2])
        st.place(s, slot, head[:2] + pool.take(1))
    st.place(3, 3, pool.take(2))  # prompt 1 alone
    other = pool.take(2)
    st.place(4, 4, other)
    pool.share(other[:1])
    st.place(5, 5, other[:1] + pool.take(1))  # shares prompt 1's first block, not yet decoding
    st.live = [0, 1, 2, 3, 4, 5]
    st.alive[:] = [True, True, True, True, True, False]
    st.prefix_groups(8)
    assert st.members[0].tolist() == [0, 1, 2, -1, -1, -1, -1, -1] and st.plen[0] == 8
    assert (st.members[1:] == -1).all() and (st.plen[1:] == 0).all()
    assert st.first.tolist() == [8, 8, 8, 0, 0, 0]
    st.prefix_groups(2)  # rows of two members: [0, 1], then 2 alone (no row)
    assert st.members[:2].tolist() == [[0, 1], [-1, -1]] and st.first.tolist() == [8, 8, 0, 0, 0, 0]
    assert st.cascade_rows == 2 and np.all(st.plen[1:] == 0)


def test_compact_moves_live_sequences_into_the_first_slots():
    """_Schedule.compact: the live sequences of slots n and up move to free slots below n with
    their blocks, table row, position, token, step and key; the vacated slots read nothing."""
    import numpy as np

    from verl_mcore.rollout import kv_blocks
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import _Schedule

    pool = BlockPool(20, 4)
    st = _Schedule([[1] * 5] * 4, SamplingParams(temperature=1.0, max_new_tokens=4), 8, 3, pool, 0)
    for s, slot in ((0, 1), (1, 5), (2, 7), (3, 2)):
        st.place(s, slot, pool.take(2))
        st.pos[slot], st.gen[slot], st.last[slot], st.slot_keys[slot] = 5 + s, 1 + s, 40 + s, 100 + s
        st.alive[slot] = True
    st.live = [1, 5, 7, 2]
    before = {s: (list(st.blocks[st.slot_of[s]]), st.table[st.slot_of[s]].tolist(), int(st.pos[st.slot_of[s]]),
                  int(st.gen[st.slot_of[s]]), int(st.last[st.slot_of[s]]), int(st.slot_keys[st.slot_of[s]]))
              for s in range(4)}
    st.compact(4)
    assert sorted(st.live) == [0, 1, 2, 3] and st.live[0] == 1 and st.live[3] == 2  # admission order kept
    for s in range(4):
        slot = st.slot_of[s]
        assert slot < 4 and st.slot_seq[slot] == s and st.alive[slot]
        assert (list(st.blocks[slot]), st.table[slot].tolist(), int(st.pos[slot]), int(st.gen[slot]),
                int(st.last[slot]), int(st.slot_keys[slot])) == before[s]
    for slot in range(4, 8):
        assert st.slot_seq[slot] == -1 and not st.alive[slot] and st.blocks[slot] == []
        assert np.all(st.table[slot] == kv_blocks.SCRATCH) and st.pos[slot] == 0
    assert st.compactions == 1
    st.compact(4)  # nothing left to move
    assert st.compactions == 1


@pytest.mark.distributed
def test_compacted_tail_gives_the_same_samples(paged):
    """Responses ending at varied lengths (a quarter of the vocabulary are stop ids): with
    compaction the live sequences move into fewer slots as others finish, and the samples,
    log-probs and finish reasons are those of the engine that steps every slot."""
    res, _, _ = paged
    want, want_stats, _ = res["varied"]
    got, stats, used = res["varied_compact"]
    assert len({len(o[2]) for o in want}) > 3  # varied lengths: a tail to compact
    assert [(o[:3], o[4]) for o in got] == [(o[:3], o[4]) for o in want]
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x[3], y[3])) < 1e-5
    assert used == 0
    assert stats["rollout/compactions"] > 0 and want_stats["rollout/compactions"] == 0
    assert stats["rollout/slot_occupancy"] > want_stats["rollout/slot_occupancy"]


def test_step_engine_stats_weigh_each_call_by_the_slots_it_stepped():
    """generation.EngineStats over a step's calls: occupancy is the live slot-steps over the
    slot-steps stepped, summed over calls (a compacted call steps fewer slots than it has), and
    compactions, preemptions and shared blocks add up; one eager call makes cuda_graphs 0."""
    from verl_mcore.generation import EngineStats

    stats = EngineStats()
    stats.add({"rollout/live_slot_steps": 30.0, "rollout/stepped_slot_steps": 40.0, "rollout/slots": 16.0,
               "rollout/decode_steps": 10.0, "rollout/slot_occupancy": 0.75, "rollout/compactions": 2.0,
               "rollout/preemptions": 1.0, "rollout/peak_live_sequences": 9.0, "rollout/cuda_graphs": 1.0,
               "rollout/kv_shared_prefix_blocks": 3.0})
    stats.add({"rollout/live_slot_steps": 10.0, "rollout/stepped_slot_steps": 60.0, "rollout/slots": 16.0,
               "rollout/decode_steps": 10.0, "rollout/slot_occupancy": 1 / 6, "rollout/compactions": 0.0,
               "rollout/preemptions": 2.0, "rollout/peak_live_sequences": 12.0, "rollout/cuda_graphs": 0.0,
               "rollout/kv_shared_prefix_blocks": 0.0})
    out = stats.take()
    assert out == {"rollout/slot_occupancy": 0.4, "rollout/compactions": 2.0, "rollout/preemptions": 3.0,
                   "rollout/peak_live_sequences": 12.0, "rollout/kv_shared_prefix_blocks": 3.0,
                   "rollout/cuda_graphs": 0.0}
    assert stats.take() == {}  # taken: the next step starts empty


def test_an_unknown_paged_kernel_choice_fails_on_every_machine(monkeypatch):
    """VERL_MCORE_PAGED_KERNEL is read before anything else decides the mode: a typo raises here
    too (CPU), not only on a GPU where it would have picked a kernel."""
    from verl_mcore.rollout.native import NativeEngine

    monkeypatch.setenv("VERL_MCORE_PAGED_KERNEL", "trition")
    with pytest.raises(ValueError, match="VERL_MCORE_PAGED_KERNEL='trition': use triton, flash"):
        NativeEngine._attention_mode(None)
