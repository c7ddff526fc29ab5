"""verl_mcore: RL post-training for LLMs on megatron-core, as an HPC batch system.

Importing the package is cheap and never imports optional accelerators (vllm,
transformer_engine, flash_attn, apex); features that need them check at config validation.
The Python API's names (`from verl_mcore import Policy, RolloutWorker, PPOTrainer, ...`) are
those of verl_mcore.api, imported when first used.
"""

__version__ = "0.1.0"

_API = ("Critic", "ExperienceBuffer", "Experiences", "Flow", "PPOTrainer", "Policy",
        "RewardModel", "RolloutWorker")


def __getattr__(name):
    # Lazy: `import verl_mcore`, which every import of a submodule runs first, stays free of
    # torch and megatron-core (the scoring workers, the user-code probe).
    if name in _API:
        from verl_mcore import api

        return getattr(api, name)
    raise AttributeError(f"module 'verl_mcore' has no attribute {name!r}")
