"""Megatron-core training engine: one `MegatronEngine` per role (model chunks, DDP, optimizer, LR
schedule, forward_backward for every layout), the batch format the trainer passes in
(`TrainBatch`), packing / micro-batching (`packing`), and the roles `Actor`, `Reference`, `Critic`.
Checkpointing (checkpoint.py) and offload (offload.py) work on an engine's `.model`, `.optimizer`,
`.scheduler` and `.config`.
"""
from verl_mcore.engine.actor import Actor, Reference
from verl_mcore.engine.batch import TrainBatch
from verl_mcore.engine.critic import Critic
from verl_mcore.engine.engine import MegatronEngine

__all__ = ["Actor", "Critic", "MegatronEngine", "Reference", "TrainBatch"]
