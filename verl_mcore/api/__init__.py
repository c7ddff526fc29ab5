"""The Python API: the components RL frameworks' integration guides show, for a loop of your own.

    from verl_mcore.api import Policy, RolloutWorker, ExperienceBuffer, PPOTrainer, Flow

    policy = Policy.from_pretrained("path/or/org-name", tensor_parallel_size=1, dtype="bf16")
    worker = RolloutWorker(policy, max_new_tokens=256, n=8, reward_fn=score)
    trainer = PPOTrainer(policy, algorithm="grpo")
    buffer = ExperienceBuffer()
    for prompts in batches:
        buffer.add(worker.generate(prompts))     # Experiences: responses, scores
        metrics = trainer.update(buffer)         # the trainer's metrics
        buffer.clear()
    policy.save_pretrained("out/hf")             # transformers loads it

`Flow([worker, buffer, trainer]).step(prompts)` is that loop's body. Thin objects over the
builders the trainer uses (verl_mcore/build.py), running the trainer's own sampler, scorer
and learner (sampler.py, scoring.py, learner.py): each object builds a Config from its arguments, checked as a config file's is
(session.py). Under torchrun / srun every rank makes the same calls (SPMD); alone, it runs in
one process. `Critic.from_pretrained` (PPO: algorithm="gae") and `RewardModel.from_pretrained`
(a learned reward, given to the worker) complete the set. examples/python_api.py is a whole run.
"""
from verl_mcore.api.buffer import ExperienceBuffer, Experiences
from verl_mcore.api.flow import Flow
from verl_mcore.api.models import Critic, Policy, RewardModel
from verl_mcore.api.ppo import PPOTrainer
from verl_mcore.api.rollout import RolloutWorker

__all__ = ["Critic", "ExperienceBuffer", "Experiences", "Flow", "PPOTrainer", "Policy",
           "RewardModel", "RolloutWorker"]
