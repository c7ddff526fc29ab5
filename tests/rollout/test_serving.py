"""Step-wise serving over the native engine (rollout/serving.py): sequences that arrive between
rounds give generate()'s tokens; a session's next turn reuses its kept KV; kept KV is evicted
when blocks run short. On CPU gloo ranks, 4-token blocks."""
import pytest

from tests.multiproc import run_on_ranks
from tests.rollout import serving_bodies as sb
from verl_mcore.rollout.serving import Request, stream_key


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.models.hf_factory import save_tiny_model

    return save_tiny_model("qwen2", str(tmp_path_factory.mktemp("serving") / "qwen2"), seed=5)


@pytest.fixture(scope="module")
def served(hf_dir):
    [res] = run_on_ranks(sb.serving_body, 1, args=(hf_dir, 1), timeout=240)
    return res


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_staggered_arrivals_give_generates_tokens(served, name):
    want = {(o[0], o[1]): o for o in served[f"{name}_generate"]}
    got = served[f"{name}_served"]
    # request ids count submissions: reversed order, the first request with a budget of 3
    assert len(got) == len(want)
    first = got[0]
    assert first[2] == want[first[:2]][2][:3]
    for rid, o in got.items():
        w = want[o[:2]]
        if rid == 0:
            continue
        assert (o[2], o[4]) == (w[2], w[4]), o[:2]
        assert max(abs(a - b) for a, b in zip(o[3], w[3])) < 1e-4
    # slots refill as sequences leave: never more than 3 live; greedy (no stop) fills all 3
    live = served[f"{name}_live"]
    assert max(live) == (3 if name == "greedy" else max(live)) <= 3 and served[f"{name}_used"] == 0
    stats = served[f"{name}_serve_stats"]
    assert stats["rollout/peak_live_sequences"] <= 3 and 0 < stats["rollout/slot_occupancy"] <= 1


@pytest.mark.distributed
def test_sampled_stop_ids_end_some_sequences(served):
    reasons = [o[4] for o in served["sampled_generate"]]
    assert "stop" in reasons  # the per-slot stop rows were exercised


@pytest.mark.distributed
def test_second_turn_prefills_only_the_new_tokens(served):
    first, cont, logprobs = served["turns"]
    prompt, observation = sb.LONG_PROMPTS[0], 7
    # the first turn's last token was never fed: it and the observation are prefilled
    assert served["turn_prefill"] == observation + 1
    assert served["turn_reused"] == len(prompt) + len(first) - 1
    assert served["kept_before_release"] == 1 and served["used_after_release"] == 0
    [(_, _, tokens, lps, _)] = served["recomputed"]
    assert cont == tokens
    assert max(abs(a - b) for a, b in zip(logprobs, lps)) < 1e-4


@pytest.mark.distributed
def test_kept_kv_is_evicted_and_recomputed_when_blocks_run_short(served):
    ev = served["evict"]
    tight_first, tight_second, evictions = ev["tight"]
    roomy_first, roomy_second, none = ev["roomy"]
    assert evictions > 0 and none == 0
    assert (tight_first, tight_second) == (roomy_first, roomy_second)
    assert ev["tight_used"] == 0 and ev["roomy_used"] == 0


@pytest.mark.distributed
def test_tp2_ranks_serve_identically(hf_dir, served):
    results = run_on_ranks(sb.serving_body, 2, args=(hf_dir, 2), timeout=300)
    assert results[0] == results[1]
    for name in ("greedy", "sampled"):
        assert {k: v[:3] for k, v in results[0][f"{name}_served"].items()} == \
            {k: v[:3] for k, v in served[f"{name}_served"].items()}


def test_stream_key_is_generates_key():
    import numpy as np

    from verl_mcore.rollout.sampling import sequence_keys

    assert stream_key(11, 3, 2) == int(sequence_keys(11, np.array([3]), np.array([2])).view(np.int64)[0])
    with pytest.raises(ValueError, match="draws must be >= 0"):
        Request((1, 2), draws=-1)
