"""The native megatron engine against transformers' greedy generate, on 1 and 2 gloo ranks, and the
weight-sync check after a repartition."""
import pytest

from tests.multiproc import run_on_ranks
from tests.rollout import engine_bodies as eb


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from tests.models.hf_factory import save_tiny_model

    out = save_tiny_model("qwen2", str(tmp_path_factory.mktemp("rollout") / "qwen2"), seed=3)
    tokens, logps = eb.hf_greedy(out, eb.PROMPTS, eb.MAX_NEW)
    return out, tokens, logps


@pytest.fixture(scope="module")
def one_rank(hf_model):
    """The engine body at TP_g = 1 (also the reference for TP_g = 2's seeded samples)."""
    [res] = run_on_ranks(eb.engine_body, 1, args=(hf_model[0], 1), timeout=240)
    return res


def _check_engine(res, hf_tokens, hf_logps):
    greedy = sorted(res["greedy"])
    assert [g[2] for g in greedy] == hf_tokens
    for g, ref in zip(greedy, hf_logps):
        assert max(abs(a - b) for a, b in zip(g[3], ref)) < 1e-4
        assert g[4] == "length" and len(g[2]) == eb.MAX_NEW
    assert [o[2] for o in res["greedy_n2"]] == [t for t in hf_tokens for _ in range(2)]
    assert res["prefill_rounds"] == [[5, 3], [7], [1, 4]]
    assert [o[2] for o in res["greedy_budgeted"]] == hf_tokens
    # n > 1: every prompt gets samples 0..2, each of max_new_tokens (no stop tokens given).
    sampled = res["sampled"]
    assert [(o[0], o[1]) for o in sampled] == [(p, j) for p in range(len(eb.PROMPTS)) for j in range(3)]
    assert all(len(o[2]) == 6 and o[4] == "length" and len(o[3]) == 6 for o in sampled)
    assert len({tuple(o[2]) for o in sampled}) > len(eb.PROMPTS)  # samples of a prompt differ
    assert all(lp <= 0.0 for o in sampled for lp in o[3])
    # Seeded sampling is reproducible, independent of the batching, and depends on the seed.
    assert res["sampled_again"] == sampled
    # Other batching: same tokens; log-probs equal up to float rounding of other matmul shapes.
    wide = res["sampled_wide"]
    assert [o[:3] for o in wide] == [o[:3] for o in sampled]
    assert max(abs(a - b) for x, y in zip(wide, sampled) for a, b in zip(x[3], y[3])) < 1e-5
    assert [o[2] for o in res["sampled_other_seed"]] != [o[2] for o in sampled]
    # Stop tokens end a sequence at their first occurrence (kept as the last token).
    stops = set(res["stops"])
    for (p, _, toks, _, reason), full in zip(res["stopped"], hf_tokens):
        cut = next((i for i, t in enumerate(full) if t in stops), None)
        if cut is None:
            assert toks == full and reason == "length"
        else:
            assert toks == full[: cut + 1] and reason == "stop"
    assert [o[4] for o in res["stopped"]].count("stop") >= 2
    # Slot occupancy: a sequence of L tokens decodes in L - 1 steps (its first comes from the
    # prefill), so the live slot-steps are the sum of L - 1; 5 sequences of varied lengths on 3
    # slots leave some idle.
    st = res["stopped_stats"]
    live = sum(len(o[2]) - 1 for o in res["stopped"])
    assert st["rollout/live_slot_steps"] == live
    # 3 slots, below min_compact_slots: every round steps all of them
    assert st["rollout/stepped_slot_steps"] == st["rollout/decode_steps"] * st["rollout/slots"]
    assert st["rollout/slot_occupancy"] == pytest.approx(live / st["rollout/stepped_slot_steps"])
    assert 0.0 < st["rollout/slot_occupancy"] < 1.0
    assert [o[2] for o in res["short"]] == [t[:1] for t in hf_tokens]
    assert res["cache_after_sleep"]
    assert [o[2] for o in res["greedy_after_wake"]] == hf_tokens


@pytest.mark.distributed
def test_native_engine_one_rank(hf_model, one_rank):
    _, tokens, logps = hf_model
    _check_engine(one_rank, tokens, logps)


@pytest.mark.distributed
def test_native_engine_tp2_identical_ranks(hf_model, one_rank):
    hf_dir, tokens, logps = hf_model
    results = run_on_ranks(eb.engine_body, 2, args=(hf_dir, 2), timeout=240)
    _check_engine(results[0], tokens, logps)
    # The vocab-parallel sampler draws the tokens TP_g = 1 draws under the same seeds (top-k and
    # top-p, top-k alone, top-p alone, neither); the log-probs differ by the float rounding of
    # the TP_g = 2 model's reductions.
    for name in ["sampled", "sampled_other_seed", *eb.SAMPLED_CUTS]:
        ours, ref = results[0][name], one_rank[name]
        assert [o[:3] for o in ours] == [o[:3] for o in ref], name
        if ref[0][3] is not None:
            diff = max(abs(a - b) for x, y in zip(ours, ref) for a, b in zip(x[3], y[3]))
            assert diff < 1e-5, (name, diff)
    assert [o[2] for o in results[0]["greedy_sequence_parallel"]] == tokens
    assert results[0]["sequence_parallel_restored"] and results[0]["sequence_parallel_flags"] > 10
    assert results[0]["mismatch_error"] is True and results[0]["mismatch_invalid_error"] is True
    # Two KV blocks of 16 tokens hold two of these short sequences at a time.
    assert results[0]["agreed_slots"] == 2 and results[0]["agreed_peak_live"] == 2
    assert results[0]["starved_error"] is True
    greedy_n2 = sorted((o[0], o[1], o[2]) for o in results[0]["greedy_n2"])
    assert sorted((o[0], o[1], o[2]) for o in results[0]["agreed_slots_n2"]) == greedy_n2
    assert results[1] == results[0]  # every TP rank samples the same tokens (and log-probs)


@pytest.mark.distributed
@pytest.mark.parametrize("tp_gen", [1, 2])
def test_native_engine_fused_decode_path(hf_model, tp_gen):
    """The fused decode step (residual add + RMSNorm, rotary + cache write, attention over each
    sequence's own keys; on CPU the ops' torch references) gives what the unfused step gives."""
    hf_dir, tokens, logps = hf_model
    results = run_on_ranks(eb.engine_body, tp_gen, args=(hf_dir, tp_gen, True), timeout=240)
    assert results[0]["fused_engine"] is True
    assert results[0]["plain_swiglu"] is True  # the MLP through fc1, decode_ops.swiglu, fc2
    _check_engine(results[0], tokens, logps)
    assert all(r == results[0] for r in results)


@pytest.mark.distributed
def test_weight_sync_check_after_repartition(hf_model):
    hf_dir, tokens, _ = hf_model
    # TP_t = 2 -> TP_g = 1: each rank is one generation replica holding the whole model.
    results = run_on_ranks(eb.sync_body, 2, args=(hf_dir, 2, 1), timeout=240)
    for rank, res in enumerate(results):
        ok = res["ok"]
        assert ok["rollout/logprob_diff_max"] < 1e-4, (rank, ok)
        assert ok["rollout/logprob_diff_mean"] <= ok["rollout/logprob_diff_max"]
        assert res["greedy"] == tokens
        assert res["buffer_released"] and res["greedy_after_wake"] == tokens
        assert res["load"]["rollout/repartition_bytes_received"] > 0
        assert res["slots"] == 4
        # Rank 0's copy was corrupted; both ranks stop together.
        assert res["corrupt"] is not None and "logprob_check.max_abs_diff" in res["corrupt"], rank


@pytest.mark.distributed
@pytest.mark.parametrize("tp_train, tp_gen, divisible_by, padded", [
    (2, 1, 128, 256),  # repartitioned TP 2 -> 1; 6 padding ids, in the second TP_t shard
    (2, 2, 100, 300),  # 50 padding ids in the second TP_g shard: gathered, then cut
])
def test_padding_ids_are_never_sampled_nor_counted(hf_model, tp_train, tp_gen, divisible_by, padded):
    """The padding rows of the LM head get huge logits; the engine's tokens and log-probs and the
    sync check's trainer log-probs stay those of the clean model."""
    hf_dir, tokens, _ = hf_model
    results = run_on_ranks(eb.padding_body, 2, args=(hf_dir, tp_train, tp_gen, divisible_by),
                           timeout=240)
    for rank, res in enumerate(results):
        assert res["padded"] == padded
        assert res["poison_margin"] > 100, rank  # unmasked, a padding id would win everywhere
        clean, poisoned = res["clean"], res["poisoned"]
        assert clean["greedy"] == tokens
        for name in ("greedy", "sampled"):
            assert poisoned[name] == clean[name], (rank, name)
            assert all(0 <= t < res["vocab"] for ts in poisoned[name] for t in ts)
            for key in (name + "_logp", name + "_trainer"):  # engine's, sync check trainer's
                diff = max(abs(a - b) for x, y in zip(poisoned[key], clean[key]) for a, b in zip(x, y))
                assert diff < 1e-5, (rank, key, diff)
        assert poisoned["check"]["rollout/logprob_diff_max"] < 1e-4, rank


def test_sleep_keeps_the_cache_within_its_budget(hf_model):
    [res] = run_on_ranks(eb.kept_cache_body, 1, args=(hf_model[0],), timeout=240)
    assert res["first"] and res["kept_again"] and res["after_move"], res
    assert res["kept_bytes"] == res["cache_bytes"] > 0
    assert res["same_cache"] and res["same_states"]
    assert res["states_renewed"] and res["freed"]
