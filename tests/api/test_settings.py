"""The API objects' settings: which object owns which config key, the Config they make, and the
errors given before anything is started (no process groups here)."""
import pytest

from verl_mcore.api import Flow, Policy, session
from verl_mcore.api.models import dtype_name
from verl_mcore.config import Config, ConfigError


def test_keyword_arguments_and_overrides_make_one_checked_config():
    tree = session.settings("Policy.from_pretrained", {
        "model.path": "m", "actor.dtype": "fp32", "actor.optim.lr": None},
        ["actor.optim.weight_decay=0.0", "parallel.tensor_model_parallel_size=2"])
    worker = session.settings("RolloutWorker", {"rollout.n": 4}, ["data.truncation=filter"])
    cfg = session.config_of(tree, worker)
    assert isinstance(cfg, Config) and cfg.model.path == "m" and cfg.actor.dtype == "fp32"
    assert cfg.actor.optim.lr == Config().actor.optim.lr  # None: the config's default
    assert cfg.actor.optim.weight_decay == 0.0 and cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.rollout.n == 4 and cfg.data.truncation == "filter"
    with pytest.raises(ConfigError, match="rollout.n: expected int, got 'four'"):
        session.config_of(session.settings("RolloutWorker", {"rollout.n": "four"}))


@pytest.mark.parametrize("who,override,owner", [
    ("PPOTrainer", "actor.optim.lr=1e-5", "Policy.from_pretrained"),
    ("PPOTrainer", "rollout.temperature=0.5", "RolloutWorker"),
    ("RolloutWorker", "actor.ppo_epochs=2", "PPOTrainer"),
    ("RolloutWorker", "rollout.tensor_parallel_size=2", "Policy.from_pretrained"),
    ("Policy.from_pretrained", "critic.optim.lr=1e-4", "Critic.from_pretrained"),
])
def test_a_key_of_another_object_names_that_object(who, override, owner):
    with pytest.raises(ConfigError, match=f"{who}: {override} is a setting of {owner}"):
        session.settings(who, {}, [override])


@pytest.mark.parametrize("override", ["checkpoint.save_every=5", "data.train_files=[a.parquet]",
                                      "trainer.val_every=2", "rollout.val_n=4"])
def test_a_key_no_api_object_reads_is_refused(override):
    with pytest.raises(ConfigError, match="the Python API does not read"):
        session.settings("RolloutWorker", {}, [override])


@pytest.mark.parametrize("override", ["algorithm.filter_groups.enable=true",
                                      "algorithm.filter_groups.max_num_gen_batches=3"])
def test_dynamic_sampling_is_refused_not_ignored(override):
    """algorithm.* are the PPOTrainer's, but no API object refills a batch: the key would
    configure nothing."""
    with pytest.raises(ConfigError, match="the Python API does not read algorithm.filter_groups"):
        session.settings("PPOTrainer", {}, [override])
    with pytest.raises(ConfigError, match="select_groups"):
        session.settings("PPOTrainer", {}, [override])


def test_every_key_an_object_owns_is_a_config_key():
    """The ownership table names real keys: a renamed schema field fails here."""
    from verl_mcore.config.loading import _all_keys

    keys = _all_keys(Config)
    for who, owned in session.OWNED.items():
        for prefix in owned:
            assert any(k == prefix or k.startswith(prefix) for k in keys), (who, prefix)


def test_data_parallel_size_must_be_what_the_ranks_leave():
    # One process: world 1, so TP=1 x PP=1 leaves DP=1; nothing is initialised before this.
    with pytest.raises(ConfigError, match=r"data_parallel_size=2 with tensor_parallel_size=1 x "
                                          r"pipeline_parallel_size=1 needs 2 ranks, but this job "
                                          r"has 1 \(which gives data_parallel_size=1\)"):
        Policy.from_pretrained("unused", data_parallel_size=2)


def test_dtype_names():
    import torch

    assert [dtype_name(d, "x") for d in ("bf16", "float32", torch.float16, None)] == [
        "bf16", "fp32", "fp16", None]
    with pytest.raises(ConfigError, match="dtype='int8'"):
        dtype_name("int8", "Policy.from_pretrained")


def test_flow_refuses_what_it_cannot_run():
    with pytest.raises(TypeError, match="stage 1 is a int"):
        Flow([lambda prompts: prompts, 3])
    with pytest.raises(ValueError, match="give the prompts"):
        Flow([lambda prompts: prompts]).step()
    assert Flow([lambda p: [x * 2 for x in p]], prompts=[[1, 2]]).step()["timing_s/step"] >= 0
