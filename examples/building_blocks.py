"""verl_mcore's building blocks in your own loop: generate -> score -> advantages -> update.

    python -m tools.make_tiny_model --out runs/quickstart/tiny_model
    python examples/building_blocks.py [MODEL_DIR]     # or: torchrun --nproc-per-node 2 ...

The whole run in one call is `Trainer(Config.load(path, overrides)).fit()`; the components of
examples/python_api.py (verl_mcore.api) do the same as objects; this script shows the builders
under them one by one, on the quickstart's tiny model and task, on CPU.
"""
import sys

import torch

from verl_mcore import build
from verl_mcore.algo.advantages import compute_advantages
from verl_mcore.config import Config
from verl_mcore.distributed.groups import build_groups
from verl_mcore.distributed.launch import detect_launch, init_distributed
from verl_mcore.reward import place_on_last_token
from verl_mcore.rollout.base import SamplingParams
from verl_mcore.rollout.batch import make_rollout


def score(response: str, digit: str) -> float:
    return sum(ch == digit for ch in response.strip()[:4]) / 4


def main(model_dir: str = "runs/quickstart/tiny_model", steps: int = 3) -> list[float]:
    # 2 prompts x rollout.n=8 samples per step, one optimizer step over all 16
    cfg = Config.load("configs/quickstart.yaml", [f"model.path={model_dir}", "data.train_batch_size=2",
                                                  "actor.ppo_mini_batch_size=2"])
    init_distributed(detect_launch(), device="cpu")
    groups = build_groups(cfg)                     # training + generation process groups
    info = build.load_model_info(cfg)              # HF architecture + tokenizer
    actor = build.build_actor(cfg, groups, info)   # megatron model, optimizer, PPO update
    rollout = build.build_generation_phase(cfg, groups, info, actor)

    digits = ["3", "7"]
    tok = info.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"repeat the digit {d} : "}],
                                           tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids for d in digits]
    mean_scores = []
    for step in range(steps):
        rollout.begin(step)                        # weights into the generation layout
        outputs = rollout.generate(prompts, SamplingParams(
            n=cfg.rollout.n, temperature=1.0, max_new_tokens=8, stop_token_ids=info.eos_token_ids, seed=step))
        rollout.end()
        samples = [(prompts[o.prompt_index], {"digit": digits[o.prompt_index]}, o.token_ids,
                    o.finish_reason) for o in outputs]
        batch = make_rollout(samples, [o.prompt_index for o in outputs], info)
        scores = torch.tensor([score(text, row["digit"]) for text, row in zip(batch.responses, batch.rows)])
        train = batch.train
        train.old_log_probs, _ = actor.compute_log_prob(train)
        rewards = place_on_last_token(scores, train.response_mask)
        train.advantages, train.returns = compute_advantages(
            "grpo", rewards, train.response_mask, group_ids=batch.group_ids)
        metrics, _ = actor.update(train)
        mean_scores.append(float(scores.mean()))
        print(f"step {step}: score {scores.mean():.3f}  pg_loss {metrics['actor/pg_loss']:.4f}  "
              f"grad_norm {metrics['actor/grad_norm']:.4f}")
    return mean_scores


if __name__ == "__main__":
    main(*sys.argv[1:2])
