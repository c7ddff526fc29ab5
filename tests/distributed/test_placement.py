"""Placement's rank arithmetic and its checks (no communication)."""
import pytest

from verl_mcore.config import Config, ConfigError
from verl_mcore.config.validate import validate
from verl_mcore.config.placement import Placement, format_ranks, parse_ranks

PPO = ["algorithm.adv_estimator=gae", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
       "actor.micro_batch_size_per_gpu=1", "critic.micro_batch_size_per_gpu=1"]
RM = ["reward.sources=[{name: rm, type: reward_model, path: rm_dir}]"]


def cfg_of(*overrides):
    return Config.load(None, list(overrides))


def test_parse_and_format_ranks():
    assert parse_ranks("0-3,8-9", "k") == [0, 1, 2, 3, 8, 9]
    assert parse_ranks([4, 5], "k") == [4, 5]
    assert parse_ranks(6, "k") == [6]
    assert format_ranks([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    for bad in ("3-1", "a-b", [1.5], True):
        with pytest.raises(ValueError, match="k"):
            parse_ranks(bad, "k")


def test_default_is_colocated():
    p = Placement.resolve(cfg_of(*PPO), 4)
    assert p.colocated and set(p.sets) == {"actor", "critic"}
    assert all(s.ranks == (0, 1, 2, 3) for s in p.sets.values())


def test_the_node_of_eight_as_users_write_it():
    cfg = cfg_of(*PPO, *RM, "parallel.tensor_model_parallel_size=2", "placement.actor=[0,1,2,3]",
                 "placement.critic=[4,5]", "placement.reward_model={ranks: [6, 7], tensor_model_parallel_size: 1}")
    p = Placement.resolve(cfg, 8)
    assert not p.colocated
    assert p.sets["actor"].ranks == (0, 1, 2, 3) and p.sets["actor"].dp == 2
    assert p.sets["critic"].ranks == (4, 5) and p.sets["critic"].tp == 2  # parallel.*'s
    assert p.sets["reward_model"].tp == 1 and p.sets["reward_model"].dp == 2
    assert p.leader("critic") == 4 and p.roles_of(5) == ["critic"]
    assert "critic: 4-5 (TP=2 PP=1 DP=1)" in p.describe()


def test_left_out_roles_go_with_the_actor_and_nodes_name_whole_nodes():
    cfg = cfg_of(*PPO, "actor.use_kl_loss=true", "placement.actor.nodes=0", "placement.critic.nodes=1")
    p = Placement.resolve(cfg, 8, gpus_per_node=4)
    assert p.sets["reference"].ranks == p.sets["actor"].ranks == (0, 1, 2, 3)
    assert p.sets["critic"].ranks == (4, 5, 6, 7)
    assert p.distinct_sets() == [p.sets["actor"], p.sets["critic"]]


@pytest.mark.parametrize("overrides,world,fragments", [
    # overlapping sets
    (["placement.actor=[0,1,2]", "placement.critic=[2,3]"], 4,
     ["placement.actor (0-2) and placement.critic (2-3) share rank(s) 2"]),
    # a set too small for its layout
    (["parallel.tensor_model_parallel_size=2", "placement.actor=[0,1]", "placement.critic=[2]",
      "placement.reward_model=[3]"], 4,
     ["placement.critic: 1 rank(s) 2 cannot hold TP×PP×CP = 2×1×1 = 2",
      "placement.reward_model: 1 rank(s) 3 cannot hold"]),
    # a GPU index beyond the node
    (["placement.actor=[0,1]", "placement.critic=[2,9]"], 4,
     ["placement.critic: GPU index / rank 9 is beyond the job's 4 ranks (0-3)"]),
    # idle ranks are named
    (["placement.actor=[0,1]", "placement.critic=[2]"], 8,
     ["rank(s) 3-7 of the job's 8 run no role"]),
    # TP_g must fit inside the actor set
    (["placement.actor=[0]", "placement.critic=[1]", "rollout.tensor_parallel_size=2",
      "parallel.tensor_model_parallel_size=2"], 2,
     ["rollout.tensor_parallel_size=2 does not fit the actor's 1 rank(s) 0"]),
    # a role the run does not have
    (["placement.reward_model=[3]"], 4, ["placement.reward_model is set, but this run has no reward model"]),
    (["placement.actor=[0,1]", "placement.critic.nodes=5"], 4, ["placement.critic.nodes: node 5 is beyond"]),
    (["placement.critic=[1,1]", "placement.actor=[0]"], 2, ["rank 1 is listed more than once"]),
    (["placement.actor={ranks: [0], tensor_model_parallel_size: 1}", "placement.critic=[1]"], 2,
     ["the actor's layout is parallel.tensor_model_parallel_size"]),
    (["placement.critic={ranks: [1], tensor_model_parallel_size: 0}", "placement.actor=[0]"], 2,
     ["placement.critic.tensor_model_parallel_size=0 must be"]),
])
def test_bad_placements_fail_naming_the_role_and_numbers(overrides, world, fragments):
    with_rm = "placement.critic=[2]" in overrides  # the one case placing a reward model
    cfg = cfg_of(*PPO, *(RM if with_rm else []), *overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world)
    for fragment in fragments:
        assert fragment in str(e.value)


def test_batch_rules_apply_inside_each_set():
    # 4 samples per mini-batch split over the critic's DP of 3 ranks... refused with its numbers;
    # the same config colocated on 4 ranks is fine.
    base = [*PPO, "rollout.n=2", "critic.micro_batch_size_per_gpu=2", "model.path=m",
            "data.train_files=[d.parquet]"]
    validate(cfg_of(*base), 4)
    with pytest.raises(ConfigError, match="per-rank critic mini-batch of 8 samples"):
        validate(cfg_of(*base, "critic.micro_batch_size_per_gpu=3", "placement.actor=[0,1,2]",
                        "placement.critic=[3]"), 4)
