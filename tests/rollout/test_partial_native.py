"""The native engine's abort (NativeServer.abort) and partial rollouts' pool over it: an aborted
request keeps its tokens so far, gives back its slot and blocks, and continued from them (same
key, draws = its tokens) samples what the uninterrupted request did. CPU gloo ranks, the tiny
model, 4-token blocks."""
import pytest

from tests.multiproc import run_on_ranks
from tests.rollout import partial_bodies as pb


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.models.hf_factory import save_tiny_model

    return save_tiny_model("qwen2", str(tmp_path_factory.mktemp("partial") / "qwen2"), seed=5)


@pytest.fixture(scope="module")
def one_rank(hf_dir):
    [res] = run_on_ranks(pb.abort_body, 1, args=(hf_dir, 1), timeout=240)
    return res


def _check(res):
    want = res["generate"]
    aborted = res["aborted"]
    # 3 slots, 2 rounds of 2 steps: the live ones had sampled some tokens, the waiting none.
    assert aborted and all(reason == "aborted" for _, _, reason in aborted.values())
    assert any(toks for toks, _, _ in aborted.values()) and any(not t for t, _, _ in aborted.values())
    for key, (toks, lps, _) in aborted.items():
        assert toks == want[key][0][:len(toks)] and len(lps) == len(toks)
    assert res["busy_after_abort"] is False and res["used_after_abort"] == 0 and res["used_at_end"] == 0
    assert {k: v for k, v in res["finished"].items()} == {k: (v[0], v[2]) for k, v in want.items()}
    # The pool: every taken group's samples are generate()'s; a sample continued over steps
    # carries the versions of the steps it ran in.
    assert len(res["pool"]) == len(pb.LONG_PROMPTS)
    spans = 0
    for serial, samples, _ in res["pool"]:
        for j, (toks, versions, finish) in enumerate(samples):
            assert (toks, finish) == (want[(serial, j)][0], want[(serial, j)][2])
            assert len(versions) == len(toks) and versions == sorted(versions)
            spans += len(set(versions)) > 1
    assert spans > 0  # some sample did run over more than one step
    assert sum(c["continued"] for _, _, c in res["pool"]) > 0


@pytest.mark.distributed
def test_abort_keeps_the_tokens_frees_the_slots_and_a_continuation_is_the_same_sample(one_rank):
    _check(one_rank)


@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_ranks_abort_and_continue_identically(hf_dir, one_rank):
    results = run_on_ranks(pb.abort_body, 2, args=(hf_dir, 2), timeout=300)
    assert results[0] == results[1]
    _check(results[0])
