"""GRPO (or PPO) on a Hugging Face checkpoint with verl_mcore's Python API, saved back to HF format.

    python examples/python_api.py MODEL_DIR OUT_DIR [grpo|gae]          # one process, CPU or GPU
    torchrun --nproc-per-node 2 examples/python_api.py MODEL_DIR OUT_DIR  # SPMD: same calls

MODEL_DIR: an HF causal LM (or a Hub id); `python -m tools.make_tiny_model --out DIR` writes the
quickstart's tiny one. The task: "repeat the digit d : " -> "dddd" (the quickstart's).
"""
import sys

from verl_mcore.api import Critic, ExperienceBuffer, Flow, Policy, PPOTrainer, RolloutWorker


def reward_fn(data_source, response, ground_truth, extra_info):
    return sum(ch == ground_truth for ch in response.strip()[:4]) / 4


def main(model_dir: str, out_dir: str, algorithm: str = "grpo", steps: int = 3, tp: int = 1):
    policy = Policy.from_pretrained(model_dir, tensor_parallel_size=tp, dtype="fp32", lr=3e-3,
                                    overrides=["actor.optim.weight_decay=0.0"])
    worker = RolloutWorker(policy, max_new_tokens=8, temperature=1.0,
                           n=8 if algorithm == "grpo" else 2, reward_fn=reward_fn)
    critic = Critic.from_pretrained(model_dir, dtype="fp32") if algorithm == "gae" else None
    trainer = PPOTrainer(policy, critic, algorithm=algorithm, kl_loss_coef=0.001)
    prompts = [{"prompt": [{"role": "user", "content": f"repeat the digit {d} : "}],
                "reward_model": {"ground_truth": d}} for d in "37"]
    flow = Flow([worker, ExperienceBuffer(), trainer])
    history = []
    for step in range(steps):
        metrics = flow.step(prompts)  # generate -> score -> (critic) -> advantages -> update
        history.append(metrics)
        print(f"step {step}: score {metrics['critic/score/mean']:.3f}  "
              f"pg_loss {metrics['actor/pg_loss']:.4f}  grad_norm {metrics['actor/grad_norm']:.4f}")
    policy.save_pretrained(out_dir, overwrite=True)  # an HF directory transformers loads
    return policy, history


if __name__ == "__main__":
    main(*sys.argv[1:4])
