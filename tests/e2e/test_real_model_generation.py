"""The trainer's generation path on a real instruct model (SmolLM2-135M-Instruct, fp32) against
transformers: greedy answers to 16 chat prompts equal token for token at TP_g = 1 and TP_g = 3
(9 query / 3 KV heads: TP 2 does not divide them, 3 is the TP above 1 that does); answers stop at
<|im_end|> with finish reason "stop", and neither the response text nor the string the scorer
gets holds it; at temperature 1 the engine's log-probs of its samples equal the actor's
recomputation (the old-log-prob pass)."""
import json

import pytest

from tests.e2e import real_model_bodies as rb
from tests.multiproc import run_on_ranks


@pytest.fixture(scope="module")
def chat(smollm2, tmp_path_factory):
    """(HF directory, data file, transformers' prompt ids and greedy responses)."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("real_chat")
    data = rb.write_chat_data(str(tmp / "chat.jsonl"))
    prompt_ids = rb.chat_ids(AutoTokenizer.from_pretrained(smollm2))
    return smollm2, data, prompt_ids, rb.hf_greedy(smollm2, prompt_ids)


def _run(chat, tmp_path, world, tp, score, sampled):
    hf_dir, data, _, _ = chat
    log = tmp_path / "scored.jsonl"
    reward = rb.write_recording_reward(str(tmp_path / "reward.py"), str(log))
    cfg = rb.overrides(hf_dir, str(tmp_path / "run"), data, reward, tp=tp, tp_gen=tp)
    res = run_on_ranks(rb.generation_body, world, args=(cfg, score, sampled), timeout=600)[0]
    return res, log


def _check_greedy(res, chat):
    _, _, prompt_ids, hf = chat
    # The dataset's chat-template rendering tokenises as transformers' own template does.
    assert res["prompt_ids"] == prompt_ids
    agree = sum(ours == theirs for ours, theirs in zip(res["response_ids"], hf))
    assert agree == len(hf), [(i, ours, theirs) for i, (ours, theirs)
                              in enumerate(zip(res["response_ids"], hf)) if ours != theirs]


@pytest.mark.distributed
def test_greedy_stop_and_sampled_logprobs_one_rank(chat, tmp_path):
    res, log = _run(chat, tmp_path, world=1, tp=1, score=True, sampled=True)
    _check_greedy(res, chat)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat[0])
    stopped = [i for i, f in enumerate(res["finish"]) if f == "stop"]
    # Both kinds occur among these prompts: answers that end, answers cut at MAX_NEW.
    assert 0 < len(stopped) < len(rb.PROMPTS)
    for i, (ids, finish, text) in enumerate(zip(res["response_ids"], res["finish"],
                                                res["responses"])):
        assert (finish == "stop") == (ids[-1] == rb.EOS) and rb.EOS not in ids[:-1], i
        assert finish == "stop" or len(ids) == rb.MAX_NEW, i
        body = ids[:-1] if finish == "stop" else ids
        assert text == tok.decode(body) and "<|im_end|>" not in text, (i, text)
    scored = dict(json.loads(line) for line in log.read_text().splitlines())
    assert scored == dict(enumerate(res["responses"]))
    assert res["scores"] == [0.0] * len(rb.PROMPTS)
    # Temperature 1: the engine's log-probs of what it sampled are the trainer's.
    t1 = res["t1"]
    mask = t1["mask"].bool()
    diff = (t1["engine"] - t1["actor"])[mask].abs().max().item()
    print(f"real-model temperature 1: engine vs actor log-probs over {int(mask.sum())} tokens: "
          f"max abs diff {diff:.2e}")
    assert diff < 1e-4, f"engine vs actor log-probs: max abs diff {diff:.2e}"
    assert int(mask.sum()) > len(rb.PROMPTS)


@pytest.mark.distributed
def test_greedy_at_generation_tp3(chat, tmp_path):
    res, _ = _run(chat, tmp_path, world=3, tp=3, score=False, sampled=False)
    _check_greedy(res, chat)
