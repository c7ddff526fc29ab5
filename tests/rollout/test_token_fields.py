"""The samples' per-token fields (rollout/token_fields.py): read from the engine's outputs with
their defaults, and carried by every path that moves samples (the gather over generation
replicas, the broadcast to other role sets, the checkpoint of batches sampled ahead) by iterating
the declaration: a field declared here, in the test, crosses all of them with no other edit."""
from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from tests.multiproc import run_on_ranks
from verl_mcore.rollout import token_fields
from verl_mcore.rollout.base import SampleOutput
from verl_mcore.rollout.batch import Rollout
from verl_mcore.rollout.token_fields import TOKEN_FIELDS, TokenField

VOCAB = 128_256
# The test's own field: two values per token (as MoE routing would have); it shares the int32
# buffer with the versions.
EXTRA = TokenField("test_routing", torch.int32, None, (2,))


class _Declared:
    """EXTRA declared while inside (restored after: the ranks are pooled processes)."""

    def __enter__(self):
        token_fields.declare(EXTRA)

    def __exit__(self, *exc):
        token_fields.retract(EXTRA.name)


def _prompts(count: int):
    from verl_mcore.data import PromptBatch

    return PromptBatch(indices=list(range(count)),
                       input_ids=[[10 + i] * (1 + i % 3) for i in range(count)],
                       rows=[{"prompt": i} for i in range(count)])


def _outputs(replica: int, count: int, n: int = 2, mask: bool = True, extra: bool = True):
    """Engine outputs with log-probs, a loss mask with a hole (`mask`), the test field and
    versions (`extra`); response lengths 0..4."""
    outs = []
    for p in range(count):
        for s in range(n):
            k = (replica + p + s) % 5
            ids = [100 * replica + 10 * p + s + t for t in range(k)]
            o = SampleOutput(p, s, ids, [-0.1 * (t + 1) - replica for t in range(k)],
                             ["stop", "length", "aborted"][(p + s) % 3], turns=1 + (p + s) % 3,
                             reward=None if s else 0.5 * p - replica)
            if mask and k >= 3:
                o.loss_mask = [1] + [0] * (k - 2) + [1]  # tool output inside the response
            if extra:
                o.extras[EXTRA.name] = [[t, -t - replica] for t in range(k)]
                o.versions = [4 + replica] * k  # sampled over a weight update, say
            outs.append(o)
    return outs


# ------------------------------------------------------------------ from the engine's outputs

def test_fields_from_outputs_with_their_defaults():
    outs = _outputs(0, 3, mask=True, extra=False)
    part = Rollout.from_outputs(_prompts(3), outs, VOCAB)
    assert set(part.token_fields) == {"logprobs", "loss_mask"}  # versions: nobody set them
    want_mask = [v for o in outs for v in (o.loss_mask or [1] * len(o.token_ids))]
    assert part.token_fields["loss_mask"].tolist() == want_mask and 0 in want_mask
    assert part.token_fields["loss_mask"].dtype == torch.uint8
    assert part.logprobs.tolist() == pytest.approx([v for o in outs for v in o.logprobs])
    t = part.response_ids.numel()
    # Not carried: the batch's version on every token.
    assert dataclasses.replace(part, version=7).token_field("versions").tolist() == [7] * t
    assert part.finish == [o.finish_reason for o in outs]
    assert "aborted" in part.finish

    # Log-probs only when every sample has them; versions on some samples only is refused.
    next(o for o in outs if o.token_ids).logprobs = None
    assert "logprobs" not in Rollout.from_outputs(_prompts(3), outs, VOCAB).token_fields
    outs[1].versions = [3] * len(outs[1].token_ids)
    with pytest.raises(ValueError, match="'versions'.*sets it on every sample"):
        Rollout.from_outputs(_prompts(3), outs, VOCAB)
    for o in outs:
        o.versions = [2] * len(o.token_ids)
    part = Rollout.from_outputs(_prompts(3), outs, VOCAB)
    assert dataclasses.replace(part, version=7).token_field("versions").tolist() == [2] * t


def test_bad_fields_name_the_sample_and_the_field():
    outs = _outputs(0, 2, extra=False)
    outs[3].loss_mask = [1]  # sample 1 of prompt 1 has more tokens than that
    with pytest.raises(ValueError, match="prompt 1 sample 1: per-token field 'loss_mask'"):
        Rollout.from_outputs(_prompts(2), outs, VOCAB)
    with pytest.raises(ValueError, match="'nope'.*not declared per-token fields"):
        Rollout.from_outputs(_prompts(1), [SampleOutput(0, 0, [1], None, "stop",
                                                            extras={"nope": [1]})], VOCAB)
    with pytest.raises(ValueError, match="set them as SampleOutput.loss_mask"):
        SampleOutput(0, 0, [1], None, "stop", extras={"loss_mask": [1]})


# ------------------------------------------------------------------ across ranks and checkpoints

def _moved_body(rank, world_size):
    """2 generation replicas gather (replica 1 without a loss mask: it gets the default), rank 0
    broadcasts the batch to rank 1 as to another role set, rank 0 saves the batch as a batch
    sampled ahead and loads it back."""
    from verl_mcore.config import Config
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups
    from verl_mcore.rollout.gather import broadcast_part, gather_rollout
    cpu_compat.install()
    with _Declared():
        groups = build_groups(Config.load(None, []))
        mine = Rollout.from_outputs(_prompts(3), _outputs(rank, 3, mask=rank == 0), VOCAB)
        batch = gather_rollout(mine, groups, VOCAB)
        sent = broadcast_part(batch if rank == 0 else None, 0, None, VOCAB,
                              None if rank == 0 else batch.prompt_rows)
        out = {"gathered": _plain(batch), "broadcast": _plain(sent)}
        if rank == 0:
            buf = io.BytesIO()
            torch.save(dataclasses.replace(batch, index=3, version=1, greedy=mine).state(), buf)
            buf.seek(0)
            loaded = Rollout.from_state(torch.load(buf, weights_only=True), batch.prompt_rows)
            out["loaded"] = (loaded.index, loaded.version, _plain(loaded), _plain(loaded.greedy))
            out["mine"] = _plain(mine)
    return out


def _plain(part):
    return {"fields": {k: (str(v.dtype), tuple(v.shape), v.tolist())
                       for k, v in part.token_fields.items()},
            "response_ids": part.response_ids.tolist(), "finish": part.finish,
            "rows": part.prompt_rows, "turns": part.turns.tolist(),
            "rewards": [None if r != r else r for r in part.sampled_rewards.tolist()]}


@pytest.mark.distributed
def test_a_declared_field_crosses_the_gather_the_broadcast_and_a_checkpoint():
    """~15 s (2 pooled gloo ranks)."""
    results = run_on_ranks(_moved_body, 2, timeout=240)
    with _Declared():
        want = [Rollout.from_outputs(_prompts(3), _outputs(r, 3, mask=r == 0), VOCAB)
                for r in (0, 1)]
    fields = results[0]["gathered"]["fields"]
    assert set(fields) == {"logprobs", "loss_mask", "versions", EXTRA.name}
    for name in (EXTRA.name, "versions"):  # the two share the int32 buffer
        values = torch.cat([w.token_fields[name] for w in want])
        assert fields[name] == ("torch.int32", tuple(values.shape), values.tolist())
    assert len(fields[EXTRA.name][1]) == 2 and fields[EXTRA.name][1][0] > 10
    assert set(fields["versions"][2]) == {4, 5}
    # Replica 1 had no loss mask: its tokens get the default 1 beside replica 0's holes.
    mask = want[0].token_fields["loss_mask"].tolist() + [1] * want[1].response_ids.numel()
    assert fields["loss_mask"] == ("torch.uint8", (len(mask),), mask) and 0 in mask
    assert fields["logprobs"][2] == pytest.approx(
        torch.cat([w.logprobs for w in want]).tolist())
    want_outs = [o for r in (0, 1) for o in _outputs(r, 3, mask=r == 0)]
    assert results[0]["gathered"]["turns"] == [o.turns for o in want_outs]
    assert results[0]["gathered"]["rewards"] == [o.reward for o in want_outs]
    for r in results:
        assert r["gathered"] == results[0]["gathered"]
        assert r["broadcast"] == results[0]["gathered"]
    index, version, part, baseline = results[0]["loaded"]
    assert (index, version) == (3, 1)
    assert part == results[0]["gathered"] and baseline == results[0]["mine"]


def test_a_checkpoint_from_before_the_declaration_still_loads():
    """Batches sampled ahead saved with the engine's log-probs at the top level (the format
    before token_fields) load with them."""
    part = Rollout.from_outputs(_prompts(2), _outputs(0, 2, mask=False, extra=False), VOCAB)
    saved = dataclasses.replace(part, index=2).state()
    saved["part"]["logprobs"] = saved["part"].pop("token_fields")["logprobs"]
    loaded = Rollout.from_state(saved, part.prompt_rows)
    assert torch.equal(loaded.logprobs, part.logprobs) and set(loaded.token_fields) == {"logprobs"}
    saved["part"]["token_fields"] = {"gone": torch.zeros(1)}
    with pytest.raises(ValueError, match="batch 2 sampled ahead.*'gone'.*not declared"):
        Rollout.from_state(saved, part.prompt_rows)


def test_merge_rules():
    assert token_fields.merged("loss_mask", [True, False])  # the other gets 1s
    assert not token_fields.merged("loss_mask", [False, False])
    assert not token_fields.merged("logprobs", [True, False])  # all or none
    assert token_fields.merged("logprobs", [True, True])
    assert not token_fields.merged("logprobs", [])


def test_a_field_gloo_cannot_send_is_refused_at_its_declaration():
    with pytest.raises(ValueError, match="'routing'.*int16.*gloo"):
        TokenField("routing", torch.int16, None)
    with pytest.raises(ValueError, match="replicas \\[1\\] carry it"):
        token_fields.merged("versions", [False, True], "replicas")
    # A replica without samples (or an empty response) has no say: nothing to fill.
    assert token_fields.merged("versions", [False, True], "replicas", tokens=[0, 5])
    assert token_fields.merged("logprobs", [False, True], "replicas", tokens=[0, 5])
    assert not token_fields.merged("logprobs", [False, True], "replicas", tokens=[3, 5])
    outs = [SampleOutput(0, 0, [1, 2], None, "stop", versions=[3, 3]),
            SampleOutput(0, 1, [], None, "stop")]
    assert Rollout.from_outputs(_prompts(1), outs, VOCAB).token_fields["versions"].tolist() \
        == [3, 3]


def test_a_checkpoint_saves_each_field_not_the_wire_buffer_it_was_cut_from():
    """A batch received over the wire holds its fields as views of one buffer per dtype (the
    versions and a declared int32 extra share one): its checkpoint saves each field's own
    values, not the whole buffer once per field."""
    with _Declared():
        part = Rollout.from_outputs(_prompts(40), _outputs(1, 40), VOCAB)
        names = list(part.token_fields)
        tokens = part.num_tokens
        buffers = {d: part.field_buffer(names, d) for d in token_fields.dtypes_of(names)}
        received = Rollout.cut(part.integers(), part.tokens(), part.prompt_rows,
                               len(part.prompt_lens), part.num_samples, part.prompt_ids.numel(),
                               token_fields.unpack(buffers, names, tokens))
        saved = received.state()["part"]

        def nbytes(t):
            buf = io.BytesIO()
            torch.save(t, buf)
            return len(buf.getvalue())

        for name in ("versions", "group_ids"):
            t = saved["token_fields"][name] if name == "versions" else saved[name]
            # its values, not a whole buffer (3 ints a token, the group ids' 4 per sample)
            assert nbytes(t) < nbytes(t.clone()) + t.nbytes // 2, name
        assert torch.equal(saved["token_fields"]["versions"], part.token_fields["versions"])


def test_declare_adds_replaces_and_retracts_only_its_own_fields():
    """A field shaped by the model (MoE routing) is declared when the run is built: again the
    same is a no-op, another shape replaces it (a new run in this process), a built-in field
    is neither replaced nor retracted, and the fields keep their order."""
    before = list(TOKEN_FIELDS)
    try:
        token_fields.declare(token_fields.routing_field(4, 2))
        token_fields.declare(token_fields.routing_field(4, 2))
        assert list(TOKEN_FIELDS) == before + ["routed_experts"]
        token_fields.declare(token_fields.routing_field(6, 8))
        assert TOKEN_FIELDS["routed_experts"].shape == (6, 8)
        assert TOKEN_FIELDS["routed_experts"].fill(1).tolist() == [[[-1] * 8] * 6]
        with pytest.raises(ValueError, match="'loss_mask' is built in"):
            token_fields.declare(TokenField("loss_mask", torch.int32, 0))
        with pytest.raises(ValueError, match="'versions' is built in"):
            token_fields.retract("versions")
    finally:
        token_fields.retract("routed_experts")
    token_fields.retract("routed_experts")  # not declared: nothing
    assert list(TOKEN_FIELDS) == before
