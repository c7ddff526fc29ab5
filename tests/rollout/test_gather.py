"""The rollout gather (rollout/gather.py, Sampler.generate) against the object gather it
replaced (tests/rollout/object_gather.py, the oracle): the same TrainBatch tensors, rows, group
ids, finish reasons and texts, on 1 rank, 2 ranks (DP_g = 2) and 4 ranks with generation TP = 2
(2 replicas), with uneven replicas, an empty replica and empty responses."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from tests.multiproc import run_on_ranks
from tests.rollout.object_gather import object_gather, old_from_sequences
from verl_mcore.rollout.base import SampleOutput
from verl_mcore.rollout.batch import Rollout, finish_codes, token_dtype

VOCAB = 128_256  # Llama 3: ids above 2**16, as a real batch has
PAD = 7


class _Tokenizer:
    """Injective stand-in: the text names every id, so texts compare the decoded ids."""

    def batch_decode(self, seqs, skip_special_tokens=True):
        return [" ".join(map(str, s)) for s in seqs]


INFO = SimpleNamespace(arch=SimpleNamespace(vocab_size=VOCAB), eos_token_ids=[PAD],
                       pad_token_id=0, tokenizer=_Tokenizer())


def _old_generate(groups, world, prompts, outputs, info):
    samples, group_ids = object_gather(groups, world, prompts, outputs)
    return dict(train=old_from_sequences([s[0] for s in samples], [s[2] for s in samples],
                                         info.eos_token_ids[0]),
                rows=[s[1] for s in samples], group_ids=torch.tensor(group_ids, dtype=torch.int64),
                responses=info.tokenizer.batch_decode([s[2] for s in samples]),
                finish=[s[3] for s in samples])


def _replica(replica: int, prompts_per_replica: list[int], n: int):
    """A replica's PromptBatch and engine outputs (shuffled: the gather sorts them), the same on
    every rank of the replica. Responses of length 0 (an engine that stopped at once) included."""
    from verl_mcore.data import PromptBatch

    rng = random.Random(1000 + replica)
    count = prompts_per_replica[replica]
    ids = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(count)]
    rows = [{"data_source": f"src{replica}", "reward_model": {"ground_truth": str(replica * 100 + i)},
             "extra_info": {"index": i, "split": "train"}} for i in range(count)]
    prompts = PromptBatch(indices=list(range(count)), input_ids=ids, rows=rows)
    outputs = [SampleOutput(p, s, [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 1, 3, 12]))],
                            None, rng.choice(["stop", "length"])) for p in range(count) for s in range(n)]
    rng.shuffle(outputs)
    return prompts, outputs


def _compare_body(rank, world_size, tp_gen, prompts_per_replica, n):
    from verl_mcore.config import Config
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups
    from verl_mcore.config.placement import Placement
    from verl_mcore.distributed.placement import RolePlacement
    from verl_mcore.sampler import Sampler

    cpu_compat.install()
    cfg = Config.load(None, [f"parallel.tensor_model_parallel_size={tp_gen}",
                             f"rollout.tensor_parallel_size={tp_gen}"])
    groups = build_groups(cfg)
    prompts, outputs = _replica(groups.gen_dp_rank, prompts_per_replica, n)
    old = _old_generate(groups, world_size, prompts, outputs, INFO)
    # Colocated: the actor set is the world, so sharing the batch with other sets is a no-op.
    place = RolePlacement(Placement.resolve(cfg, world_size), {"actor": groups}, rank)
    engine = SimpleNamespace(generate=lambda ids, sampling: outputs, check_samples=dict,
                             groups=groups)
    new = Sampler(cfg, INFO, place, engine).generate(prompts, sampling=None)
    shared = [new.rows[i] is new.rows[j] for i in range(len(new.rows)) for j in range(i)
              if new.group_ids[i] == new.group_ids[j]]
    return dict(old=old, new=new, shared=shared)


def _check(results):
    for rank, r in enumerate(results):
        old, new = r["old"], r["new"]
        for field in ("input_ids", "prompt_lens", "seq_lens", "response_mask"):
            a, b = getattr(old["train"], field), getattr(new.train, field)
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: TrainBatch.{field}"
        assert new.rows == old["rows"], f"rank {rank}: rows"
        assert torch.equal(new.group_ids, old["group_ids"]) and new.group_ids.dtype == torch.int64
        assert new.responses == old["responses"], f"rank {rank}: responses"
        assert new.finish == old["finish"], f"rank {rank}: finish"
        assert all(r["shared"]), "samples of one prompt share its row dict"
        assert torch.equal(results[0]["new"].train.input_ids, new.train.input_ids)
    masked = results[0]["new"].train.response_mask.sum(-1) == 0
    assert bool(masked.any()), "the data has empty responses (one masked pad token each)"


@pytest.mark.parametrize("world, tp_gen, prompts_per_replica", [
    (1, 1, [5]),
    (2, 1, [3, 5]),  # uneven
    (2, 1, [0, 4]),  # an empty replica (validation's last batch)
    (4, 2, [6, 2]),  # two replicas of TP_g = 2: only TP_g rank 0 sends
])
def test_tensor_gather_equals_object_gather(world, tp_gen, prompts_per_replica):
    _check(run_on_ranks(_compare_body, world, args=(tp_gen, prompts_per_replica, 3), timeout=240))


def test_token_dtype_and_finish_codes():
    assert token_dtype(VOCAB) == torch.int32 and token_dtype(2**31 + 1) == torch.int64
    with pytest.raises(OverflowError):  # an id past int32 is refused, not wrapped
        Rollout.from_samples([([1], {}, [2**31], "stop")], vocab_size=VOCAB)
    assert finish_codes(["length", "stop"]).tolist() == [1, 0]
    with pytest.raises(ValueError, match="'abort'"):
        finish_codes(["stop", "abort"])


def _broadcast_body(rank, world_size, fail_on):
    """Rank 1 holds a part with the engine's log-probs and sends it to ranks 0 and 2 (rows from
    their own copy), or fails (`fail_on` == 1), or a receiver fails (`fail_on` == 2)."""
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.rollout.gather import GenerationFailure, broadcast_part

    cpu_compat.install()
    prompts, outputs = _replica(0, [4], 2)
    for o in outputs:
        o.logprobs = [-0.25 * (k + 1) for k in range(len(o.token_ids))]
    part = Rollout.from_outputs(prompts, outputs, VOCAB) if rank == 1 else None
    failure = RuntimeError(f"engine broke on rank {rank}") if rank == fail_on else None
    try:
        got = broadcast_part(part, 1, None, VOCAB, None if rank == 1 else prompts.rows,
                             failure=failure, who="the rollout set")
    except GenerationFailure as e:
        return ("GenerationFailure", str(e))
    except RuntimeError as e:
        return ("RuntimeError", str(e))
    sent = Rollout.from_outputs(prompts, outputs, VOCAB)
    same = all(torch.equal(getattr(got, f), getattr(sent, f)) for f in
               ("prompt_ids", "prompt_lens", "response_ids", "response_lens", "prompt_of",
                "finish_codes", "turns", "logprobs"))
    return ("ok", same and got.rows == sent.rows)


def test_broadcast_part_sends_the_batch_or_the_senders_failure():
    assert run_on_ranks(_broadcast_body, 3, args=(None,)) == [("ok", True)] * 3
    for fail_on in (1, 2):  # the sender, and another rank of the generating set
        failed = run_on_ranks(_broadcast_body, 3, args=(fail_on,))
        assert failed[fail_on] == ("RuntimeError", f"engine broke on rank {fail_on}")
        for rank in {0, 1, 2} - {fail_on}:  # no rank waits for a batch that will not come
            assert failed[rank] == ("GenerationFailure", f"rank {fail_on} failed before handing "
                                    f"over the rollout set's batch: RuntimeError: engine broke "
                                    f"on rank {fail_on}")
