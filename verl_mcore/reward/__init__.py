"""Rewards: built-in rule scorers, user functions, routing, weighted sources, reward models.

    from verl_mcore.reward import RewardManager, default_compute_score, place_on_last_token

A scorer is `score(data_source, response, ground_truth, extra_info) -> float | {"score": ...}`.
`default_compute_score` is the built-in dispatch by data_source (GSM8K, MATH, DAPO; builtin.py).
"""
from verl_mcore.reward.builtin import default_compute_score
from verl_mcore.reward.manager import RewardManager, RewardModel, RewardOutput

__all__ = ["RewardManager", "RewardModel", "RewardOutput", "default_compute_score",
           "place_on_last_token"]


def __getattr__(name):
    # Lazy: importing torch would slow down every spawned scoring worker, which needs none of it.
    if name == "place_on_last_token":
        from verl_mcore.reward.placement import place_on_last_token

        return place_on_last_token
    raise AttributeError(f"module 'verl_mcore.reward' has no attribute {name!r}")
