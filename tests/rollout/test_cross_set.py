"""The actor's weights to a rollout set of its own (rollout/cross_set.py), against the unsharded
model: every rollout rank ends with exactly its TP_g slice, having received only that."""
import pytest
import torch

from tests.multiproc import run_on_ranks
from tests.rollout.test_repartition import _semantic_slice


def _model(config, pg, stage: int, stages: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.distributed import tiny_gpt

    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=tiny_gpt.VOCAB, max_sequence_length=tiny_gpt.SEQ,
                    pre_process=stage == 0, post_process=stage == stages - 1,
                    position_embedding_type="rope", pg_collection=pg)


class _PlusOne:
    """Stands in for a LoRA adapter: the merged weight is W + 1 (a new tensor, W untouched)."""

    def merged(self, weight):
        return weight + 1.0


def _body(rank, world_size, actor_ranks, tp, pp, rollout_ranks, tp_gen, merge_name):
    from megatron.core import parallel_state

    from tests.distributed import tiny_gpt
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import GroupLayout, build_set_groups, destroy_groups
    from verl_mcore.rollout.cross_set import CrossSetPlan, CrossSetTransfer
    from verl_mcore.rollout.repartition import global_param_names

    cpu_compat.install()
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    full = {n: p.detach().clone() for n, p in tiny_gpt.build_model(tiny_gpt.make_config()).named_parameters()}
    parallel_state.destroy_model_parallel()

    actor_layout = GroupLayout(len(actor_ranks), tp, pp, ranks=actor_ranks)
    rollout_layout = GroupLayout(len(rollout_ranks), tp_gen, 1, tp_gen=tp_gen, ranks=rollout_ranks)
    actor, rollout = build_set_groups([actor_layout, rollout_layout], 5)
    try:
        plan = CrossSetPlan(actor_layout, rollout_ranks, tp_gen)
        if actor is not None:
            train = _model(tiny_gpt.make_config(tp, pp), actor.train, actor.pp_rank, pp)
            with torch.no_grad():
                for name, p in global_param_names(train).items():
                    p.copy_(_semantic_slice(full[name], name, actor.tp_rank, tp))
            before = {n: p.detach().clone() for n, p in train.named_parameters()}
            merge = {merge_name: _PlusOne()} if merge_name in global_param_names(train) else None
            move = CrossSetTransfer(plan, rank, True, train_chunks=[train], merge=merge)
            first, second = move.run(), move.run()
            untouched = all(torch.equal(p, before[n]) for n, p in train.named_parameters())
            return {"sent": first.bytes_sent, "received": first.bytes_received,
                    "again": second.bytes_sent, "untouched": untouched}
        gen = _model(tiny_gpt.make_config(tp_gen, 1, perform_initialization=False), rollout.gen, 0, 1)
        move = CrossSetTransfer(plan, rank, True, gen_model=gen)
        want = {n: _semantic_slice(full[n] + (1.0 if n == merge_name else 0.0), n, rollout.gen_tp_rank,
                                   tp_gen) for n in global_param_names(gen)}
        stats = move.run()
        mismatched = [n for n, p in global_param_names(gen).items() if not torch.equal(p, want[n])]
        move.release()
        again = move.run()  # into the released buffer: restored, refilled
        mismatched_again = [n for n, p in global_param_names(gen).items() if not torch.equal(p, want[n])]
        gen_bytes = sum(p.numel() * p.element_size() for p in gen.parameters())
        largest = max(p.numel() * p.element_size() for p in gen.parameters())
        return {"mismatched": mismatched, "mismatched_again": mismatched_again, "stats": stats,
                "again": again.bytes_received, "gen_bytes": gen_bytes, "largest": largest,
                "names": sorted(global_param_names(gen)), "full": sorted(full)}
    finally:
        destroy_groups()


@pytest.mark.distributed
@pytest.mark.parametrize("actor_ranks, tp, pp, rollout_ranks, tp_gen", [
    ((0, 1), 2, 1, (2, 3), 1),  # TP_t = 2·TP_g: two shards merge into one; two replicas
    ((0, 1), 1, 2, (2, 3), 2),  # TP_g = 2·TP_t, from two pipeline stages: each gets half a shard
    ((0, 1), 1, 1, (2, 3), 1),  # actor DP=2: replica r is served by DP replica r
    ((0, 1, 2), 1, 1, (3,), 1),  # DP=3 actor, one rollout rank
    ((2, 3), 2, 1, (0, 1), 2),  # rollout on the lower ranks, equal TP
])
def test_rollout_ranks_receive_exactly_their_generation_slices(actor_ranks, tp, pp, rollout_ranks, tp_gen):
    merge_name = "decoder.layers.1.self_attention.linear_qkv.weight"
    world = len(actor_ranks) + len(rollout_ranks)
    results = run_on_ranks(_body, world, args=(actor_ranks, tp, pp, rollout_ranks, tp_gen, merge_name),
                           timeout=240)
    received = 0
    for rank in rollout_ranks:
        r = results[rank]
        assert r["mismatched"] == [] and r["mismatched_again"] == [], f"rank {rank}"
        assert r["names"] == r["full"]
        s = r["stats"]
        # A rollout rank starts with nothing: its TP_g shard is what it must receive, and all it does.
        assert s.bytes_received == s.min_bytes_received == s.generation_bytes == r["gen_bytes"]
        assert r["again"] == s.bytes_received
        assert s.peak_temp_bytes <= 2 * r["largest"]
        received += s.bytes_received
    sent = sum(results[rank]["sent"] for rank in actor_ranks)
    assert sent == received  # nothing is sent that is not used
    for rank in actor_ranks:
        assert results[rank]["received"] == 0 and results[rank]["untouched"], f"rank {rank}"
        assert results[rank]["again"] == results[rank]["sent"]
    if len(set(actor_ranks)) > 1 and tp == 1 and pp == 1:
        # DP replicas share the sending: both actor ranks serve a replica each.
        assert all(results[rank]["sent"] > 0 for rank in actor_ranks[:len(rollout_ranks)])


def test_plan_routes_and_refusals():
    from verl_mcore.distributed.groups import GroupLayout
    from verl_mcore.rollout.cross_set import CrossSetPlan

    # actor TP=4 PP=2 on 0-7; rollout TP_g=2 on 8-11 (two replicas, both from DP replica 0).
    plan = CrossSetPlan(GroupLayout(8, 4, 2, ranks=tuple(range(8))), (8, 9, 10, 11), 2)
    routes = plan.routes(stage=1, kind="qkv")
    assert [(r.receiver, r.senders, r.piece) for r in routes] == [
        (8, (4, 5), None), (9, (6, 7), None), (10, (4, 5), None), (11, (6, 7), None)]
    assert [r.senders for r in plan.routes(0, "replicated")] == [(0,), (2,), (0,), (2,)]
    assert plan.generation_shape((48, 64), "qkv") == (96, 64)
    assert plan.generation_shape((64, 32), "row") == (64, 64)
    # TP_g = 4 from TP_t = 2: each sender's shard is cut in two.
    wide = CrossSetPlan(GroupLayout(2, 2, 1, ranks=(0, 1)), (2, 3, 4, 5), 4)
    assert [(r.senders, r.piece) for r in wide.routes(0, "row")] == [
        ((0,), (0, 2)), ((0,), (1, 2)), ((1,), (0, 2)), ((1,), (1, 2))]
    assert wide.generation_shape((64, 32), "row") == (64, 16)
    with pytest.raises(ValueError, match="one must divide the other"):
        CrossSetPlan(GroupLayout(3, 3, 1), (3, 4), 2)
    with pytest.raises(ValueError, match="do not divide into replicas"):
        CrossSetPlan(GroupLayout(2, 2, 1), (2, 3, 4), 2)
    with pytest.raises(ValueError, match="in both the actor and the rollout set"):
        CrossSetPlan(GroupLayout(2, 2, 1), (1, 2), 1)


def _mismatch_body(rank, world_size):
    from megatron.core import parallel_state  # noqa: F401

    from tests.distributed import tiny_gpt
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import GroupLayout, build_set_groups, destroy_groups
    from verl_mcore.rollout.cross_set import CrossSetPlan, CrossSetTransfer

    cpu_compat.install()
    actor_layout, rollout_layout = GroupLayout(1, 1, 1, ranks=(0,)), GroupLayout(1, 1, 1, ranks=(1,))
    actor, rollout = build_set_groups([actor_layout, rollout_layout], 5)
    try:
        plan = CrossSetPlan(actor_layout, (1,), 1)
        kw = ({"train_chunks": [_model(tiny_gpt.make_config(), actor.train, 0, 1)]} if actor else
              {"gen_model": _model(tiny_gpt.make_config(ffn_hidden_size=64), rollout.gen, 0, 1)})
        try:
            CrossSetTransfer(plan, rank, True, **kw)
        except ValueError as e:
            return str(e)
        return "built"
    finally:
        destroy_groups()


@pytest.mark.distributed
def test_a_mismatched_rollout_model_is_refused_on_every_rank_before_any_weight_moves():
    results = run_on_ranks(_mismatch_body, 2, timeout=120)
    for text in results:
        assert "the rollout model does not match the actor" in text
        assert "linear_fc1.weight" in text and "(256, 64)" in text
