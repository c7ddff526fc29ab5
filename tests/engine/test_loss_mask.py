"""The samples' loss mask becomes the batch's response mask (TrainBatch.from_flat,
rollout.batch.Rollout.for_learner): tokens the model did not write (tool output) are holes, 0 inside
the response. What reads the mask then leaves them out: the actor's loss and its normaliser;
the score goes to the last token the model wrote and reaches the tokens before the hole."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.multiproc import run_on_ranks
from verl_mcore.algo.advantages import compute_advantages
from verl_mcore.engine.batch import TrainBatch
from verl_mcore.reward import place_on_last_token
from verl_mcore.rollout.base import SampleOutput
from verl_mcore.rollout.batch import Rollout

PAD = 7
VOCAB = 128  # the tiny model's (tests/engine/common.py)


class _Tokenizer:
    def batch_decode(self, seqs, skip_special_tokens=True):
        return [" ".join(map(str, s)) for s in seqs]


INFO = SimpleNamespace(arch=SimpleNamespace(vocab_size=VOCAB), eos_token_ids=[PAD],
                       pad_token_id=0, tokenizer=_Tokenizer())


def _part():
    """Prompt 0: a response with a tool's output (2 tokens) inside, and one that ends in a
    tool's output; prompt 1: an unmasked response and an empty one."""
    from verl_mcore.data import PromptBatch

    prompts = PromptBatch(indices=[0, 1], input_ids=[[1, 2, 3], [4]], rows=[{}, {}])
    outs = [SampleOutput(0, 0, [10, 11, 12, 13, 14], [-1.0, -2.0, -3.0, -4.0, -5.0], "stop",
                         loss_mask=[1, 0, 0, 1, 1]),
            SampleOutput(0, 1, [20, 21, 22], [-6.0, -7.0, -8.0], "aborted", loss_mask=[1, 1, 0]),
            SampleOutput(1, 0, [30, 31], [-9.0, -10.0], "length"),
            SampleOutput(1, 1, [], [], "stop")]
    return Rollout.from_outputs(prompts, outs, VOCAB)


MASK = [[1, 0, 0, 1, 1], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]


def test_from_flat_takes_the_loss_mask_inside_the_response():
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    got = TrainBatch.from_flat(ids[:1], torch.tensor([1]), ids[1:], torch.tensor([3, 0, 2]), PAD,
                               prompt_of=torch.tensor([0, 0, 0]),
                               loss_mask=torch.tensor([1, 0, 1, 0, 1], dtype=torch.uint8))
    assert got.response_mask.tolist() == [[1, 0, 1], [0, 0, 0], [0, 1, 0]]
    assert got.response_mask.dtype == torch.float32
    assert got.input_ids.tolist() == [[5, 6, 7, 8], [5, PAD, PAD, PAD], [5, 9, 10, PAD]]
    for bad in (torch.ones(4), torch.tensor([1, 0, 2, 0, 1])):
        with pytest.raises(ValueError, match="loss_mask must be 0/1, one per response token"):
            TrainBatch.from_flat(ids[:1], torch.tensor([1]), ids[1:], torch.tensor([3, 0, 2]),
                                 PAD, prompt_of=torch.tensor([0, 0, 0]), loss_mask=bad)


def test_the_rollout_of_samples_with_holes():
    part = _part()
    rollout = part.for_learner(INFO)
    train = rollout.train
    assert train.response_mask.tolist() == MASK
    assert train.response_lens.tolist() == [5, 3, 2, 1]  # the holes are still response tokens
    assert rollout.finish == ["stop", "aborted", "length", "stop"]
    # The engine's log-probs sit at their tokens, holes included (not at the mask's 1s).
    assert rollout.engine_log_probs.tolist() == [[-1.0, -2.0, -3.0, -4.0, -5.0],
                                                 [-6.0, -7.0, -8.0, 0.0, 0.0],
                                                 [-9.0, -10.0, 0.0, 0.0, 0.0],
                                                 [0.0] * 5]


def test_the_score_goes_to_the_last_token_the_model_wrote_and_crosses_the_holes():
    part = _part()
    mask = part.for_learner(INFO).train.response_mask
    rewards = place_on_last_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    # Holes before the last token change nothing; a response ending in a tool's output has its
    # score on the model's last token (column 1), not on the masked one (column 2).
    want = torch.zeros(4, 5)
    want[0, 4], want[1, 1], want[2, 1] = 1.0, 2.0, 3.0
    assert torch.equal(rewards, want)
    # GAE (values 0, gamma = lam = 1) skips the holes: every token the model wrote gets its
    # response's score, every hole 0.
    adv, _ = compute_advantages("gae", rewards, mask, values=torch.zeros(4, 5), gamma=1.0,
                                lam=1.0, whiten=False)
    assert adv.tolist() == [[1, 0, 0, 1, 1], [2, 2, 0, 0, 0], [3, 3, 0, 0, 0], [0] * 5]


def _actor_body(rank, world_size):
    """One on-policy PPO step (ratio 1: the loss is -mean of the advantages over the tokens that
    count) on the rollout of `_part`, and the same step with absurd advantages at the holes."""
    from tests.engine import common as C
    from verl_mcore.engine.actor import Actor
    torch.manual_seed(0)
    part = _part()
    full = C.reference_weights("actor", seed=4)
    cfg = C.actor_config(ppo_epochs=1, use_kl_loss=False, entropy_coeff=0.0,
                         optim=C.optim_config(lr_warmup_steps=0))
    adv = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    out = {"adv": adv}
    for name in ("plain", "absurd_at_holes"):
        batch = part.for_learner(INFO).train
        holes = batch.response_field_mask() & ~batch.response_mask.bool()
        batch.advantages = torch.where(holes, torch.tensor(1e4), adv) if name != "plain" else adv
        actor = Actor(C.make_engine("actor", full, optim=cfg.optim), cfg, mini_batch_size=4)
        summary, _ = actor.update(batch)
        out[name] = (summary["actor/pg_loss"],
                     [p.detach().clone() for p in actor.engine.model[0].parameters()])
    return out


@pytest.mark.distributed
def test_holes_are_out_of_the_actors_loss_and_its_normaliser():
    """~15 s (1 pooled rank, the tiny model)."""
    out = run_on_ranks(_actor_body, 1, timeout=300)[0]
    mask = torch.tensor(MASK, dtype=torch.float32)
    counted = -(out["adv"] * mask).sum() / mask.sum()  # 7 tokens, not the 10 of the responses
    assert out["plain"][0] == pytest.approx(float(counted), rel=1e-5)
    assert out["absurd_at_holes"][0] == pytest.approx(float(counted), rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(out["plain"][1], out["absurd_at_holes"][1]))
