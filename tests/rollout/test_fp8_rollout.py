"""rollout.dtype=fp8: the native engine's e4m3 generation copy (rollout/fp8_weights.py), filled
by the repartition (in place) or copied from the training model, against full precision and
against transformers running the same FP8 linears; the weight-sync check at its FP8 bound."""
import pytest

from tests.multiproc import run_on_ranks
from tests.rollout import engine_bodies as eb
from tests.rollout import fp8_bodies as fb


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from tests.models.hf_factory import save_tiny_model

    return save_tiny_model("qwen2", str(tmp_path_factory.mktemp("fp8") / "qwen2"), seed=3)


@pytest.fixture(scope="module")
def one_rank(hf_model):
    [res] = run_on_ranks(fb.copy_body, 1, args=(hf_model,), timeout=240)
    return res


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of greedy positions where two runs chose the same token, up to each pair's first
    difference (after it, the contexts differ and agreement means nothing)."""
    same = total = 0
    for x, y in zip(a, b):
        first = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        same += first
        total += len(x)
    return same / total


@pytest.mark.distributed
def test_fp8_engine_equals_transformers_with_the_same_fp8_linears(hf_model, one_rank):
    tokens, logps = fb.hf_fp8_greedy(hf_model, eb.PROMPTS, fb.NEW)
    got_tokens, got_logps = one_rank["fp8"]
    assert got_tokens == tokens
    worst = max(abs(a - b) for g, r in zip(got_logps, logps) for a, b in zip(g, r))
    assert worst < 1e-4, worst
    # the fused decode step and a sleep / wake / load_weights cycle change nothing
    assert one_rank["fused_engine"] is True
    assert one_rank["fp8_fused"][0] == got_tokens
    assert max(abs(a - b) for g, r in zip(one_rank["fp8_fused"][1], got_logps) for a, b in zip(g, r)) < 1e-5
    assert one_rank["released"] and one_rank["fp8_after_wake"] == one_rank["fp8"]
    assert one_rank["refresh_follows"]


@pytest.mark.distributed
def test_fp8_greedy_agrees_with_full_precision_on_most_tokens(one_rank):
    """The share the report quotes: greedy tokens of the FP8 engine equal to the fp32 engine's
    up to each sequence's first difference, on a random tiny model (its logits are flatter than
    a trained model's: near-ties flip sooner)."""
    share = _agreement(one_rank["fp8"][0], one_rank["full"][0])
    print(f"FP8 vs fp32 greedy agreement (tiny random qwen2, {len(eb.PROMPTS)} x {fb.NEW}): {share:.0%}")
    assert share >= 0.6
    # the training model's own weights are untouched; the copy is 1 byte per weight + a scale per row
    assert one_rank["linear_dtypes"] == ["torch.float32"]
    assert one_rank["store_bytes"] == one_rank["linear_numel"] + 4 * one_rank["linear_rows"]


@pytest.mark.distributed
def test_repartition_quantizes_into_an_fp8_generation_model(hf_model, one_rank):
    """TP_t = 2 -> TP_g = 1 on two gloo ranks: each generation replica holds the whole model, its
    linear weights e4m3 (quantized as assembled), the same numbers as the one-rank copy."""
    results = run_on_ranks(fb.repartition_body, 2, args=(hf_model, 2), timeout=300)
    for res in results:
        assert res["linear_dtypes"] == ["torch.float8_e4m3fn"]
        assert res["buffer_numel"] == res["expected_buffer_numel"]  # no fp32 copy of the linears
        assert res["generation_bytes"] == res["expected_generation_bytes"]
        assert res["peak_temp_bytes"] > 0
        assert res["fp8"][0] == one_rank["fp8"][0]
        assert res["released"] and res["fp8_after_wake"][0] == res["fp8"][0]
        # the check passes at the FP8 bound with the FP8 difference visible; a broken copy
        # differs by far more and fails a bound that FP8 alone passes
        check, corrupt = res["check"], res["corrupt_check"]
        assert 1e-4 < check["rollout/logprob_diff_mean"] < check["rollout/logprob_diff_max"] < 0.5
        assert corrupt["rollout/logprob_diff_max"] > 10 * check["rollout/logprob_diff_max"]
        assert res["corrupt"] is not None and "max_abs_diff=0.5" in res["corrupt"]
