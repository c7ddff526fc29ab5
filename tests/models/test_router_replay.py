"""Routing replay (models/router_replay.py): where the engine and the trainer route a near-tie
differently, the trainer's log-probs differ from the engine's; with the engine's routing replayed
they are equal, and the replay counts the one token-layer whose routing it changed."""
import pytest
import torch

from tests.models import hf_factory, replay_bodies
from tests.multiproc import run_on_ranks

POSITION, EPS = 5, 1e-4


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    return {f: hf_factory.save_tiny_model(f, str(root / f), seed=3) for f in ("qwen2_moe", "mixtral")}


@pytest.mark.parametrize("family, layer", [("qwen2_moe", 2),  # softmax, then top-k: probs gathered
                                           ("mixtral", 0)])  # top-k logits, then softmax over them
def test_replay_makes_trainer_log_probs_equal_the_engines_on_a_near_tie(moe_dirs, family, layer):
    tokens = torch.randint(0, hf_factory.COMMON["vocab_size"], (1, 12),
                           generator=torch.Generator().manual_seed(11))
    [res] = run_on_ranks(replay_bodies.near_tie_body, 1,
                         args=(moe_dirs[family], tokens, POSITION, layer, EPS), timeout=240)
    assert res["flipped"][1] in res["engine_chose"]  # the engine took the other expert
    diff = (res["plain"] - res["engine"]).abs()[0]
    # log-prob i is of token i + 1: positions before the near-tie see the same network
    assert diff[:POSITION].max() < 1e-5
    assert diff[POSITION:].max() > 1e-3, diff
    replayed = (res["replayed"] - res["engine"]).abs().max()
    assert replayed < 1e-4, replayed  # left: the gates' eps-sized difference
    assert res["differed"] == 1
    assert res["forced"] == tokens.shape[1] * res["moe_layers"]


@pytest.mark.distributed
def test_old_log_probs_equal_the_engines_through_the_trainers_data_path(moe_dirs):
    """The engine records its routing, the routing crosses the Rollout, the learner's batch and
    the micro-batches (packed and padded), and the actor's old log-probs and the reference's
    equal the engine's log-probs where, without the routing, they differ from the first
    response token on (the near-tie at the prompt's last position). The mismatch metric is
    the share of replayed token-layers whose own routing differed (the near-tie's, one per
    sample at least), and the update still moves the router (its gates carry gradients)."""
    prompt = [5, 17, 42, 99, 7, 31]
    [res] = run_on_ranks(replay_bodies.trainer_path_body, 1,
                         args=(moe_dirs["qwen2_moe"], prompt, 2, EPS), timeout=300)
    kth, next_ = res["flipped"]
    assert all(next_ in row and kth not in row for row in res["first_routed"])
    assert (res["plain"] - res["engine"]).abs().max() > 1e-3
    for name in ("replayed", "padded", "reference"):
        diff = (res[name] - res["engine"]).abs().max()
        assert diff < 1e-4, (name, diff)
    differed, forced = res["counts"]
    assert forced == res["tokens"] * res["moe_layers"] and 2 <= differed < forced / 4
    assert res["metric"] == pytest.approx(differed / forced)
    assert res["router_moved"] > 0
    assert res["check"]["replayed"] < 1e-4 < 1e-3 < res["check"]["plain"]  # the weight-sync check
