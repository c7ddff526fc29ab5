"""One seed a user sets: trainer.seed reaches every random stream of a run (as verl's does).

    stream          its own key (set: it wins)   drawn from
    rollout         rollout.seed                 sampling: per batch, rollout.seed + 1000003 x the
                                                 batch (trainer.sampling) + the replica
    data            data.seed                    the prompt order of each epoch (PromptLoader), a
                                                 custom dataset's max_samples choice
    lora/actor      -                            the actor's adapters' initial values
    lora/critic     -                            the critic's adapters' initial values
    (roles)         -                            build.role_seed(trainer.seed, role): fresh heads
                                                 (the critic's value head) built under torch's
                                                 CPU generator
    (process)       -                            trainer.seed itself: torch's generators, megatron's
                                                 model-parallel RNG tracker (dropout, LoRA
                                                 dropout), Python's and numpy's (+ the rank)

A key left null derives its stream's seed from trainer.seed, and each stream gets its own:
sha256 of "trainer.seed/stream", so that no two streams draw one sequence (a sampling seed equal
to the shuffling seed would correlate which prompts come with which samples across seeds), and a
neighbouring trainer.seed gives unrelated streams, not shifted ones. Derived seeds lie in
[0, 2**31): every generator the streams feed (numpy's default_rng, torch's manual_seed, vLLM's
per-request int seed) takes them.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

STREAMS = ("rollout", "data", "lora/actor", "lora/critic")


def stream_seed(seed: int, stream: str) -> int:
    """The seed of `stream` derived from trainer.seed `seed` (see the module docstring)."""
    if stream not in STREAMS:
        raise ValueError(f"stream_seed: unknown stream {stream!r}; one of {STREAMS}")
    digest = hashlib.sha256(f"{seed}/{stream}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _own_or_derived(own: Optional[int], seed: int, stream: str) -> int:
    return own if own is not None else stream_seed(seed, stream)


def rollout_seed(cfg) -> int:
    """The base seed of sampling: rollout.seed, or derived from trainer.seed."""
    return _own_or_derived(cfg.rollout.seed, cfg.trainer.seed, "rollout")


def data_seed(cfg) -> int:
    """The seed of the prompt order and of max_samples' choice: data.seed, or derived from
    trainer.seed."""
    return _own_or_derived(cfg.data.seed, cfg.trainer.seed, "data")


def lora_seed(cfg, role: str) -> int:
    """The seed of `role`'s ("actor" / "critic") LoRA adapters' initial values."""
    return stream_seed(cfg.trainer.seed, f"lora/{role}")


def rollout_config(cfg):
    """cfg.rollout with its seed resolved: what the engines and the weight-sync check read."""
    return dataclasses.replace(cfg.rollout, seed=rollout_seed(cfg))


def data_config(cfg):
    """cfg.data with its seed resolved: what the datasets (max_samples) read."""
    return dataclasses.replace(cfg.data, seed=data_seed(cfg))


def resolve_seeds(cfg):
    """`cfg` with rollout.seed and data.seed set to the seeds the run draws from (derived where
    null): the two configs a resume compares (config/resume.py). The saved config.yaml keeps
    null (a run started again from it with another trainer.seed draws other streams)."""
    return dataclasses.replace(cfg, rollout=rollout_config(cfg), data=data_config(cfg))


def resolve_saved_seeds(tree: dict) -> dict:
    """resolve_seeds for a saved config.yaml's tree (a checkpoint's record), so that a resume
    compares the seeds the two configs draw from: a checkpoint whose config left data.seed null
    and a config that sets it to the derived value agree; another trainer.seed with data.seed
    null changes the prompt order (config/resume.py refuses it)."""
    trainer = tree.get("trainer") or {}
    if "seed" not in trainer:
        return tree  # written before trainer.seed existed: nothing to derive from
    out = dict(tree)
    for section, stream in (("rollout", "rollout"), ("data", "data")):
        part = dict(out.get(section) or {})
        if part.get("seed") is None:
            part["seed"] = stream_seed(trainer["seed"], stream)
        out[section] = part
    return out
