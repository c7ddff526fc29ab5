"""Reward models as the trainer builds them (build.build_reward_models): a tiny HF
Qwen2ForSequenceClassification and a Llama one, written by transformers here, score a batch of
prompt + response sequences equal to transformers' own pooled logits (<= 1e-5 relative) at TP=1
(packed and padded micro-batches) and TP=2; and with a tokenizer that differs from the actor's
(a chat template of its own), the samples are re-tokenised through the reward model's template
and scored as transformers scores those ids."""
from __future__ import annotations

import pytest

from tests.models import hf_factory
from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

TOL = 1e-5
# Word-level vocabulary (tests/models/hf_factory): turn markers must be words of it.
TEMPLATE = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("rm")
    out = {family: hf_factory.save_tiny_model(family, str(root / family), seed=3, seq_cls=True,
                                              vocab_size=256) for family in ("qwen2", "llama2")}
    # A tokenizer within the 256 embeddings: transformers loads qwen2's as a Qwen2Tokenizer,
    # which adds <|endoftext|> after the 250 words (a tokenizer with more ids than the model has
    # embeddings is refused before any model is built).
    for family in ("qwen2", "llama2"):
        hf_factory.write_tokenizer(out[family], 250)
    # The same weights with a tokenizer of its own: the actor's ids cannot be reused. (Llama:
    # transformers loads a qwen2 directory's word-level tokenizer as a Qwen2Tokenizer, which
    # tokenises these words to nothing.)
    out["templated"] = hf_factory.save_tiny_model("llama2", str(root / "templated"), seed=3,
                                                  seq_cls=True, vocab_size=256)
    hf_factory.write_tokenizer(out["templated"], 250)
    tok = AutoTokenizer.from_pretrained(out["templated"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out["templated"])
    return out


def _samples():
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in (3, 7, 2, 5, 9)]
    responses = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in (4, 1, 8, 6, 3)]
    return prompts, responses


def _score_body(rank, world_size, actor_dir, rm_dir, tp, micro):
    from verl_mcore import build
    from verl_mcore.config import Config
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups, destroy_groups
    from verl_mcore.engine.batch import TrainBatch

    cpu_compat.install()
    cfg = Config.load(None, [
        f"model.path={actor_dir}", f"parallel.tensor_model_parallel_size={tp}",
        "reward.sources=[{name: rm, type: reward_model, path: " + rm_dir + ", dtype: fp32, "
        + micro + "}]"])
    groups = build_groups(cfg)
    try:
        info = build.load_model_info(cfg)
        scorer = build.build_reward_models(cfg, groups, info)["rm"]
        prompts, responses = _samples()
        batch = TrainBatch.from_sequences(prompts, responses, pad_token_id=0)
        words = [" ".join(f"w{t}" for t in r) for r in responses]
        rows = [{"prompt": [{"role": "user", "content": " ".join(f"w{t}" for t in p)}]}
                for p in prompts]
        scores = scorer.score(batch, rows, words)
        return {"scores": scores, "retokenize": scorer.retokenize}
    finally:
        destroy_groups()


def _transformers_scores(rm_dir, sequences):
    import torch
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
    with torch.no_grad():  # one sequence at a time: pooled at its last token, no padding involved
        return torch.tensor([model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences])


@pytest.mark.parametrize("family,tp,micro", [
    ("qwen2", 1, "max_tokens_per_microbatch: 16"), ("qwen2", 1, "micro_batch_size: 2"),
    ("qwen2", 2, "max_tokens_per_microbatch: 24"), ("llama2", 1, "max_tokens_per_microbatch: 16"),
    pytest.param("llama2", 2, "micro_batch_size: 3", marks=pytest.mark.slow),
])
def test_scores_equal_transformers(dirs, family, tp, micro):
    prompts, responses = _samples()
    want = _transformers_scores(dirs[family], [p + r for p, r in zip(prompts, responses)])
    for r in run_on_ranks(_score_body, tp, args=(dirs[family], dirs[family], tp, micro), timeout=240):
        assert r["retokenize"] is False  # the actor's tokenizer: its ids are scored as they are
        err = ((r["scores"] - want).abs().max() / want.abs().max()).item()
        assert err <= TOL, (r["scores"], want)


def test_another_tokenizer_rescores_through_its_chat_template(dirs):
    from transformers import AutoTokenizer

    prompts, responses = _samples()
    tok = AutoTokenizer.from_pretrained(dirs["templated"])
    sequences = []
    for p, r in zip(prompts, responses):
        messages = [{"role": "user", "content": " ".join(f"w{t}" for t in p)},
                    {"role": "assistant", "content": " ".join(f"w{t}" for t in r)}]
        ids = tok.apply_chat_template(messages, tokenize=True)
        sequences.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    # The template adds w3 / w4 around each turn: not the actor's ids.
    assert all(len(s) == len(p) + len(r) + 4 for s, p, r in zip(sequences, prompts, responses))
    want = _transformers_scores(dirs["templated"], sequences)
    r = run_on_ranks(_score_body, 1, args=(dirs["llama2"], dirs["templated"], 1,
                                           "max_tokens_per_microbatch: 32"), timeout=240)[0]
    assert r["retokenize"] is True
    err = ((r["scores"] - want).abs().max() / want.abs().max()).item()
    assert err <= TOL, (r["scores"], want)
