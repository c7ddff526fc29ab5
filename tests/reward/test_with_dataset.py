"""The path the trainer takes: preprocessed GSM8K -> dataset -> prompt batch -> responses ->
rewards -> token-level reward tensor."""
import json

import torch

from tests.data.tiny_tokenizer import make_tiny_tokenizer
from tools.preprocess_gsm8k import main as preprocess
from verl_mcore.config.schema import DataConfig, RewardConfig
from verl_mcore.data import PromptLoader, build_dataset
from verl_mcore.reward import RewardManager, place_on_last_token


def test_gsm8k_prompts_to_token_rewards(tmp_path):
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": f"How many clips {i} ?",
                                "answer": f"so {i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n")
    [path] = preprocess(["--input", str(tmp_path / "train.jsonl"), "--out-dir", str(tmp_path)])
    data_cfg = DataConfig(max_prompt_length=64, train_batch_size=4)
    ds = build_dataset(path, make_tiny_tokenizer(), data_cfg)
    batch = next(PromptLoader(ds, data_cfg.train_batch_size, seed=1))
    n = 2  # rollout.n: every prompt's row travels with each of its responses
    rows = [r for r in batch.rows for _ in range(n)]
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    responses = [f"#### {t}" if k % 2 == 0 else "#### -1" for k, t in enumerate(truths)]
    with RewardManager.from_config(RewardConfig(num_workers=0)) as manager:
        manager.check_dataset(ds)
        out = manager.score(responses, rows)
    assert out.scores == [1.0, 0.0] * 4
    mask = torch.ones(8, 5, dtype=torch.int64)
    mask[:, 3:] = 0  # responses of 3 tokens, right-padded
    rewards = place_on_last_token(out.scores, mask)
    assert rewards[:, 2].tolist() == out.scores and rewards.sum().item() == 4.0
