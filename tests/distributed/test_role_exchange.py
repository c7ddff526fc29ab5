"""The exchanges between role sets (distributed/placement.RolePlacement) on 3 gloo ranks, without
models: a result computed on one set reaches every rank as a tensor; the rollout batch crosses
from the actor set with each rank's own dataset rows; a failure on one set raises on every rank
(no rank waits on a collective that will not come); metrics of every set are merged."""
from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_on_ranks


def _placement():
    from verl_mcore.config.placement import Placement, RoleSet
    from verl_mcore.distributed.placement import RolePlacement

    p = Placement(3, {"actor": RoleSet((0, 1), 1, 1), "critic": RoleSet((2,), 1, 1)})
    return p, lambda rank: RolePlacement(p, {r: object() if rank in s.ranks else None
                                             for r, s in p.sets.items()}, rank)


def _exchange_body(rank, world_size):
    from verl_mcore.data.loader import PromptBatch
    from verl_mcore.rollout.batch import Rollout
    from verl_mcore.rollout.gather import share_rollout

    _, make = _placement()
    place = make(rank)
    out = {}
    # The critic's values [2, 3] on every rank; a result kept on its set (share=False).
    values = place.on("critic", lambda: torch.arange(6.0).view(2, 3) + 0.5, [2, 3])
    out["values"] = values.tolist()
    out["kept"] = place.on("actor", lambda: torch.ones(2), [2], share=False)
    out["kept"] = None if out["kept"] is None else out["kept"].tolist()
    # The actor set's rollout part: tokens cross, rows come from each rank's own prompts.
    rows = [{"p": 0, "rank_saw": rank}, {"p": 1, "rank_saw": rank}]
    part = None
    if rank in (0, 1):
        part = Rollout.from_samples([([5, 6], rows[0], [7, 8, 9], "stop"),
                                     ([4], rows[1], [], "length")], vocab_size=32)
    prompts = PromptBatch(indices=[0, 1], input_ids=[[5, 6], [4]], rows=rows)
    got = share_rollout(place, part, prompts, vocab_size=32)
    out["tokens"] = got.tokens().tolist()
    out["response_lens"] = got.response_lens.tolist()
    out["finish"] = got.finish
    out["rows"] = got.prompt_rows
    # Metrics: every set's keys on every rank, rank 0's first; each set's phase times named.
    metrics = {"actor/pg_loss": 1.0, "timing_s/actor": 2.0} if rank < 2 else \
        {"critic/vf_loss": 3.0, "timing_s/critic": 4.0}
    out["metrics"] = place.gather_metrics(metrics, step=1)
    return out


@pytest.mark.distributed
def test_results_rollouts_and_metrics_cross_role_sets_as_tensors():
    results = run_on_ranks(_exchange_body, 3, timeout=120)
    for rank, r in enumerate(results):
        assert r["values"] == [[0.5, 1.5, 2.5], [3.5, 4.5, 5.5]]
        assert r["kept"] == ([1.0, 1.0] if rank < 2 else None)
        assert r["tokens"] == [5, 6, 4, 7, 8, 9]
        assert r["response_lens"] == [3, 0] and r["finish"] == ["stop", "length"]
        assert [row["rank_saw"] for row in r["rows"]] == [rank, rank]  # its own rows, not sent
        m = r["metrics"]
        assert m["actor/pg_loss"] == 1.0 and m["critic/vf_loss"] == 3.0
        assert m["timing_s/actor/actor"] == 2.0 and m["timing_s/critic/critic"] == 4.0


def _failure_body(rank, world_size, where):
    from verl_mcore.errors import RoleSetFailure
    from verl_mcore.errors import NonFiniteError

    _, make = _placement()
    place = make(rank)

    def broken():
        raise NonFiniteError("critic grad norm nan")

    try:
        if where == "on":  # a result the others wait for
            place.on("critic", broken, [2])
        else:  # an update: the other sets finish their own work, then all stop together
            place.run("critic", lambda: broken())
            place.run("actor", lambda: {"actor/pg_loss": 1.0})
            place.gather_metrics({}, step=4)
    except (NonFiniteError, RoleSetFailure) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["on", "run"])
def test_a_failure_on_one_set_stops_every_rank(where):
    results = run_on_ranks(_failure_body, 3, args=(where,), timeout=120)
    assert results[2] == ("NonFiniteError", "critic grad norm nan")  # its own error
    for kind, text in results[:2]:
        assert "the critic set (ranks 2)" in text and "rank 2" in text
        # A held update failure keeps its class, so every rank stops the same way.
        assert kind == ("NonFiniteError" if where == "run" else "RoleSetFailure")
