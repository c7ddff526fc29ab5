"""The agent-loop runtime (agent/runtime.py) over the native engine's serving session, with a toy
loop that waits (asyncio) between turns and appends fixed observation tokens: token in, token
out; loss mask 0 exactly on observations; turns counted; the KV of a trajectory reused across
its turns; limits; TP_g = 2 ranks returning the same trajectories. CPU gloo ranks, tiny model."""
import pytest

from tests.agent import runtime_bodies as rb
from tests.agent.toy_loop import OBSERVATION
from tests.multiproc import run_on_ranks


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.models.hf_factory import save_tiny_model

    return save_tiny_model("qwen2", str(tmp_path_factory.mktemp("agent") / "qwen2"), seed=5)


@pytest.fixture(scope="module")
def ran(hf_dir):
    [res] = run_on_ranks(rb.runtime_body, 1, args=(hf_dir, 1), timeout=300)
    return res


def _segments(o):
    """The response's runs of equal loss mask: [(mask, tokens)]."""
    tokens, mask = o[2], o[5]
    out = []
    for t, m in zip(tokens, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["toy", "toy_greedy"])
def test_toy_loop_token_in_token_out(ran, case):
    outs = ran[case]
    assert [(o[0], o[1]) for o in outs] == [(p, j) for p in range(len(rb.LONG_PROMPTS)) for j in range(2)]
    for o in outs:
        prompt = rb.LONG_PROMPTS[o[0]]
        seen = o[8]["seen"]
        assert o[6] == 3 == len(seen) and o[7] == 3.0  # turns counted; the loop's reward kept
        # model turns exactly as sampled, observations between them with mask 0
        assert _segments(o) == [(1, seen[0][1]), (0, list(OBSERVATION)), (1, seen[1][1]),
                                (0, list(OBSERVATION)), (1, seen[2][1])]
        assert all(lp == 0.0 for lp, m in zip(o[3], o[5]) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(o[3], o[5]) if m == 1)
        # each turn continued the trajectory as it stood
        assert seen[1][0] == prompt + seen[0][1] + list(OBSERVATION)
        assert o[4] == "length"  # 4 new tokens a turn, no stop ids: each turn hit its limit
    assert ran["used"] == 0  # every block back, kept sessions released


@pytest.mark.distributed
def test_model_tokens_are_what_the_engine_samples(ran):
    # sampled: each turn re-served alone (its context, key and counter) gives its tokens
    assert all(a == b for a, b in ran["toy_again"]) and len(ran["toy_again"]) == 3 * 2 * len(rb.LONG_PROMPTS)
    # greedy: each turn is generate()'s continuation of its context
    turns = [t for o in ran["toy_greedy"] for _, t, _ in o[8]["seen"]]
    assert turns == ran["greedy_recomputed"]
    # other waits, other rounds: the same trajectories (log-probs up to float rounding: other
    # batch shapes)
    other, toy = ran["toy_unstaggered"], ran["toy"]
    assert [o[:3] + o[4:6] for o in other] == [o[:3] + o[4:6] for o in toy]
    assert max(abs(a - b) for x, y in zip(other, toy) for a, b in zip(x[3], y[3])) < 1e-4


@pytest.mark.distributed
def test_later_turns_prefill_only_the_new_tokens(ran):
    stats = ran["toy_stats"]
    trajectories = 2 * len(rb.LONG_PROMPTS)
    # first turns: each prompt once (its 2 samples share it); later turns: the last sampled
    # token and the observation, nothing of the cached prefix
    want = sum(map(len, rb.LONG_PROMPTS)) + trajectories * 2 * (1 + len(OBSERVATION))
    assert stats["rollout/prefill_tokens"] == want
    assert stats["rollout/kv_reused_tokens"] > 0 and stats["rollout/kv_kept_evictions"] == 0


@pytest.mark.distributed
def test_runtime_metrics(ran):
    m = ran["toy_metrics"]
    tokens = 3 * 4 + 2 * len(OBSERVATION)
    assert m["agent/turns_mean"] == 3.0 and m["agent/trajectories"] == 2 * len(rb.LONG_PROMPTS)
    assert m["agent/observation_tokens_mean"] == 2 * len(OBSERVATION)
    assert m["agent/masked_share"] == pytest.approx(2 * len(OBSERVATION) / tokens)
    assert m["agent/tool_wait_seconds_mean"] > 0.01 and m["agent/rounds"] > 3
    assert 0 < m["rollout/slot_occupancy"] <= 1


@pytest.mark.distributed
def test_one_turn_loop_is_generate(ran):
    assert [o[:5] for o in ran["one_turn"]] == ran["generated"]


@pytest.mark.distributed
def test_limits_end_trajectories_with_length(ran):
    for o in ran["max_turns"]:  # a third turn asked for: cut
        assert o[6] == 2 and o[4] == "length" and len(o[2]) == 2 * 3 + 2 * 4
    for o in ran["budget"]:  # 12 tokens: 3 model, 4 observation, 3 model, 2 of the observation
        assert len(o[2]) == 12 and o[4] == "length" and o[5] == [1] * 3 + [0] * 4 + [1] * 3 + [0] * 2
        assert o[6] == 2


@pytest.mark.distributed
def test_a_raising_loop_names_its_file_and_line(ran):
    msg = ran["raises"]
    assert "toy_loop.py:Raises raised KeyError: 'no such tool'" in msg and "line" in msg
    assert "prompt 0, sample 0" in msg


@pytest.mark.distributed
def test_tp2_ranks_return_the_same_trajectories(hf_dir, ran):
    """About 16 s (two ranks)."""
    results = run_on_ranks(rb.runtime_body, 2, args=(hf_dir, 2, ("toy", "raises")), timeout=400)
    assert results[0]["toy"] == results[1]["toy"]
    assert [o[5] for o in results[0]["toy"]] == [o[5] for o in ran["toy"]]
    assert "no such tool" in results[1]["raises"]  # the first rank's error, on the other rank too


@pytest.mark.distributed
def test_routing_replay_records_each_turns_experts_and_none_for_observations(tmp_path):
    """actor.router_replay=rollout with an agent loop: a trajectory's routed_experts are, for
    each model token, what the engine's MoE layers routed the position before it to (the
    prefill of each later turn included) and -1 on observation tokens."""
    from tests.models.hf_factory import save_tiny_model

    hf_moe = save_tiny_model("qwen2_moe", str(tmp_path / "qwen2_moe"), seed=3)
    [res] = run_on_ranks(rb.routing_body, 1, args=(hf_moe,), timeout=300)
    assert res["bad"] == [] and len(res["shapes"]) == 1
    assert max(res["turns"]) > 1 and res["observed"] > 0
