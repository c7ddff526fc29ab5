"""Repartition and native generation inside an actor set of its own: the actor on ranks [2, 3]
at TP=2 (ranks 0 and 1 hold another role), generating at TP_g = 1 (a repartition inside the
set's micro-DP group) and TP_g = 2 (the training model itself), gives the tokens of the
colocated 2-rank run of the same seed, and the rollout gathered inside the set is the colocated
run's global batch; megatron's parallel_state is never initialised."""
from __future__ import annotations

import pytest

from tests.models import hf_factory
from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

PROMPTS = [[5, 17, 42, 99, 7], [3, 200, 11], [150, 151, 152, 153, 154, 155, 9], [77]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = hf_factory.save_tiny_model("qwen2", str(tmp_path_factory.mktemp("gen") / "actor"),
                                     seed=1, vocab_size=256)
    hf_factory.write_tokenizer(out, 250)
    return out


def _generate(cfg, groups):
    """Greedy and seeded-sampled tokens of the actor's generation phase on this rank."""
    from types import SimpleNamespace

    import torch

    from verl_mcore import build
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    info = build.load_model_info(cfg)
    torch.manual_seed(0)
    actor = SimpleNamespace(engine=build.build_engine(cfg, groups, info, "actor", "fp32"))
    model, repartitioner = build.build_generation_model(cfg, groups, info, actor)
    engine = NativeEngine(model, vocab_size=info.arch.vocab_size,
                          tp_group=groups.gen_tp if groups.layout.tp_gen > 1 else None,
                          repartitioner=repartitioner, max_num_seqs=3)
    engine.load_weights()
    out = {}
    for name, sp in [("greedy", SamplingParams(temperature=0.0, max_new_tokens=6)),
                     ("sampled", SamplingParams(n=2, temperature=0.9, top_k=40, max_new_tokens=5,
                                                seed=11 + groups.gen_dp_rank))]:
        out[name] = sorted((o.prompt_index, o.sample_index, o.token_ids)
                           for o in engine.generate(PROMPTS, sp))
    # The replicas' samples gathered inside the set: every actor rank holds the global batch.
    from verl_mcore.rollout.batch import Rollout
    from verl_mcore.rollout.gather import gather_rollout

    lead = groups.gen_tp_rank == 0
    mine = Rollout.from_samples([(PROMPTS[p], {"prompt": p}, t, "length")
                                     for p, _, t in out["sampled"]], 256) if lead else None
    batch = gather_rollout(mine, groups, 256)
    out["gathered"] = (batch.response_ids.tolist(), batch.response_lens.tolist(), batch.prompt_rows)
    out["repartitioned"] = repartitioner is not None
    out["gen_dp_rank"] = groups.gen_dp_rank
    return out


def _config(hf_dir, tp_gen):
    from verl_mcore.config import Config

    return Config.load(None, [f"model.path={hf_dir}", "parallel.tensor_model_parallel_size=2",
                              "actor.dtype=fp32", f"rollout.tensor_parallel_size={tp_gen}"])


def _colocated_body(rank, world_size, hf_dir, tp_gen):
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups, destroy_groups

    cpu_compat.install()
    cfg = _config(hf_dir, tp_gen)
    groups = build_groups(cfg)
    try:
        return _generate(cfg, groups)
    finally:
        destroy_groups()


def _placed_body(rank, world_size, hf_dir, tp_gen):
    from megatron.core import parallel_state

    from verl_mcore import build
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import GroupLayout, build_set_groups, destroy_groups

    cpu_compat.install()
    cfg = _config(hf_dir, tp_gen)
    other, actor = build_set_groups([GroupLayout(2, 1, 1, ranks=(0, 1)),
                                     GroupLayout(2, 2, 1, tp_gen=tp_gen, ranks=(2, 3))], 5)
    try:
        assert not parallel_state.model_parallel_is_initialized()
        if actor is None:  # the other role: a forward-only engine of its own at TP=1, DP=2
            info = build.load_model_info(cfg)
            engine = build.build_engine(cfg, other, info, "critic", "fp32")
            return {"other_dp": engine.dp_size}
        return _generate(cfg, actor)
    finally:
        destroy_groups()


@pytest.mark.parametrize("tp_gen", [1, 2])
def test_generation_in_an_actor_set_matches_colocated(hf_dir, tp_gen):
    want = run_on_ranks(_colocated_body, 2, args=(hf_dir, tp_gen), timeout=240)
    got = run_on_ranks(_placed_body, 4, args=(hf_dir, tp_gen), timeout=240)
    assert got[0] == got[1] == {"other_dp": 2}
    assert got[2:] == want
    assert want[0]["repartitioned"] == (tp_gen == 1)
    assert [r["gen_dp_rank"] for r in want] == ([0, 1] if tp_gen == 1 else [0, 0])
