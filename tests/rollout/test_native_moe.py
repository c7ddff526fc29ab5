"""The native engine decodes mixture-of-experts models (rollout/moe_mlp.py): greedy tokens equal
transformers' and log-probs within float rounding, for each MoE family, at TP_g 1 and 2, with
grouped expert GEMMs or one GEMM per expert."""
import pytest

from tests.models import hf_factory
from tests.multiproc import run_on_ranks
from tests.rollout import engine_bodies as eb
from tests.rollout import moe_engine_bodies as meb


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_rollout")
    out = {}
    for family in hf_factory.MOE_FAMILIES:
        path = hf_factory.save_tiny_model(family, str(root / family), seed=3)
        out[family] = (path, *eb.hf_greedy(path, eb.PROMPTS, eb.MAX_NEW))
    return out


def _check(res, tokens, logps, moe_layers):
    assert res["tokens"] == tokens
    diff = max(abs(a - b) for ours, ref in zip(res["logprobs"], logps) for a, b in zip(ours, ref))
    assert diff < 1e-4, diff
    assert res["moe_layers"] == moe_layers


MOE_LAYERS = {"qwen2_moe": 3, "qwen3_moe": 4, "mixtral": 4}  # qwen2_moe's layer 1 is dense


@pytest.mark.distributed
@pytest.mark.parametrize("family", hf_factory.MOE_FAMILIES)
def test_moe_greedy_equals_transformers(hf_models, family):
    path, tokens, logps = hf_models[family]
    [res] = run_on_ranks(meb.greedy_body, 1, args=(path, 1, True, True), timeout=240)
    _check(res, tokens, logps, MOE_LAYERS[family])
    assert all(res["grouped"]) and res["views_of_buffer"]
    assert res["last_experts"][0][1] == 2  # top-2


@pytest.mark.distributed
def test_moe_tp2_and_one_gemm_per_expert(hf_models):
    """TP_g = 2 (each expert sliced like a dense MLP, the partial sums all-reduced) and the
    per-expert fallback, both on weights loaded on their own (re-homed into a stack)."""
    path, tokens, logps = hf_models["qwen2_moe"]
    results = run_on_ranks(meb.greedy_body, 2, args=(path, 2, False, True), timeout=240)
    for res in results:
        _check(res, tokens, logps, 3)
    [res] = run_on_ranks(meb.greedy_body, 1, args=(path, 1, False, False), timeout=240)
    _check(res, tokens, logps, 3)
    assert not any(res["grouped"])


@pytest.mark.distributed
def test_moe_through_the_fused_decode_step(hf_models):
    """The fused decode step calls the MoE MLP where it calls a dense one (on CPU its ops run
    their torch references)."""
    path, tokens, logps = hf_models["mixtral"]
    [res] = run_on_ranks(meb.greedy_body, 1, args=(path, 1, True, True, True), timeout=240)
    assert res["fused"]
    _check(res, tokens, logps, 4)


def _check_repartition(results, tokens, world, pp, ep):
    for res in results:
        assert res["mismatched"] == [], res["mismatched"][:5]
        assert res["tokens"] == tokens
        # Each rank starts with its stage's layers and its EP block of their experts and ends
        # with every weight: what it lacked is the least it can receive, and it receives that.
        assert res["received"] == res["lower_bound"] == res["gen_bytes"] - res["train_bytes"]
    if pp == 1:  # everything but the other EP ranks' experts is already here
        assert results[0]["received"] == results[0]["expert_bytes"] * (ep - 1) // ep


@pytest.mark.distributed
def test_repartition_moves_experts_from_ep2(hf_models):
    path, tokens, _ = hf_models["qwen3_moe"]
    results = run_on_ranks(meb.repartition_body, 2, args=(path, 1, 2, 1), timeout=240)
    _check_repartition(results, tokens, 2, 1, 2)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_repartition_moves_experts_from_ep2_pp2(hf_models, family):
    path, tokens, _ = hf_models[family]
    results = run_on_ranks(meb.repartition_body, 4, args=(path, 2, 2, 1), timeout=300)
    _check_repartition(results, tokens, 4, 2, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("family, fused", [("qwen2_moe", False), ("mixtral", True)])
def test_engine_records_the_experts_its_forward_chose(hf_models, family, fused):
    """Routing replay's engine side: every response token's routed_experts are the experts
    MoEDecodeMLP.route picks on the hidden states that produced it (the prefill's last position
    for the first token, decode steps after), through generate (shared prompt prefills, queued
    sequences, several rounds) and a serving session (a kept session's continuation), plain
    and fused decode steps; -1 on dense layers; recording changes no token."""
    path = hf_models[family][0]
    [res] = run_on_ranks(meb.routing_body, 1, args=(path, fused), timeout=240)
    assert res["bad"] == []
    assert res["shapes"] == [(res["layers"], res["topk"])]
    assert res["outputs"] == 2 * 5 + 3
    assert res["same_tokens"] and res["plain_extras"] == [{}]
