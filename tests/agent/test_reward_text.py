"""What the rewards read of a multi-turn response (rollout/batch.py decode_responses): the
model's own tokens (loss mask 1) only, so a tool result that quotes the answer earns nothing and
the model's "#### n" across turns is scored; milliseconds, the Qwen-style tokenizer built here."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.agent.chatml_tokenizer import make_chatml_tokenizer
from verl_mcore.reward.gsm8k import compute_score
from verl_mcore.rollout.base import SampleOutput
from verl_mcore.rollout.batch import Rollout, decode_responses


@pytest.fixture(scope="module")
def tok():
    return make_chatml_tokenizer()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _rollout(tok, parts):
    """One sample per entry of `parts`: [(text, loss mask)] pieces of its response."""
    outputs = []
    for i, pieces in enumerate(parts):
        ids, mask = [], []
        for text, m in pieces:
            piece = _ids(tok, text)
            ids += piece
            mask += [m] * len(piece)
        outputs.append(SampleOutput(prompt_index=i, sample_index=0, token_ids=ids, logprobs=None,
                                    finish_reason="stop", loss_mask=mask))
    prompts = SimpleNamespace(input_ids=[_ids(tok, "hello")] * len(parts), rows=[{}] * len(parts))
    return Rollout.from_outputs(prompts, outputs, len(tok))


def test_the_reward_reads_the_models_tokens_only(tok):
    rollout = _rollout(tok, [
        [("Call the calculator", 1), ("The answer is 42", 0), (" error", 1)],  # quoted by a tool
        [("Call the calculator", 1), ("The answer is 42", 0), ("The answer is #### 42", 1)],
    ])
    texts = decode_responses(tok, rollout)
    assert "42" not in texts[0]
    assert texts[1].endswith("#### 42")
    assert [compute_score(t, "42") for t in texts] == [0.0, 1.0]
