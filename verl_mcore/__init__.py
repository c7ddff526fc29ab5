"""verl_mcore: RL post-training for LLMs on megatron-core, as an HPC batch system.

Importing the package is cheap and never imports optional accelerators (vllm,
transformer_engine, flash_attn, apex); features that need them check at config validation.
"""

__version__ = "0.1.0"
