"""config/seeds.py: trainer.seed reaches every stream, each its own; an explicit stream seed wins;
a resume compares the seeds the runs draw from."""
import pytest

from tests.engine.common import arch
from verl_mcore.config import Config, resume
from verl_mcore.config.seeds import (
    STREAMS,
    data_seed,
    lora_seed,
    resolve_saved_seeds,
    rollout_seed,
    stream_seed,
)


def test_streams_are_distinct_stable_and_in_range():
    seeds = {(s, stream): stream_seed(s, stream) for s in (0, 1, 42, 2**32 - 1) for stream in STREAMS}
    assert len(set(seeds.values())) == len(seeds)  # no two streams (or trainer seeds) share one
    assert all(0 <= v < 2**31 for v in seeds.values())
    # Fixed by the rule (sha256 of "seed/stream"): a change here changes every run's numbers.
    assert stream_seed(42, "rollout") == 524108591 and stream_seed(42, "data") == 289865421
    with pytest.raises(ValueError, match="unknown stream 'dropout'"):
        stream_seed(42, "dropout")


def test_null_seeds_follow_trainer_seed_and_set_ones_win():
    derived = Config.load(None, ["trainer.seed=7"])
    assert derived.rollout.seed is None and derived.data.seed is None  # the schema's default
    assert rollout_seed(derived) == stream_seed(7, "rollout")
    assert data_seed(derived) == stream_seed(7, "data")
    assert rollout_seed(Config.load(None, ["trainer.seed=8"])) != rollout_seed(derived)
    own = Config.load(None, ["trainer.seed=7", "rollout.seed=5", "data.seed=0"])
    assert (rollout_seed(own), data_seed(own)) == (5, 0)
    assert lora_seed(own, "actor") != lora_seed(own, "critic")
    assert lora_seed(own, "actor") == stream_seed(7, "lora/actor")


def _saved(tmp_path, cfg):
    path = tmp_path / "step_00000004"
    path.mkdir()
    for name, text in resume.checkpoint_files(cfg, arch()).items():
        (path / name).write_text(text)
    return str(path)


def test_resume_refuses_another_trainer_seed_under_a_derived_data_seed(tmp_path):
    ckpt = _saved(tmp_path, Config.load(None, ["trainer.seed=1"]))  # data.seed null: derived
    with pytest.raises(resume.ResumeConfigError) as e:
        resume.compare(ckpt, Config.load(None, ["trainer.seed=2"]), arch())
    assert f"data.seed: {stream_seed(1, 'data')} in the checkpoint -> {stream_seed(2, 'data')}" \
        in str(e.value)
    # The same order, set explicitly: accepted; trainer.seed and the sampling seed change.
    same = Config.load(None, ["trainer.seed=2", f"data.seed={stream_seed(1, 'data')}"])
    changes = {c.key for c in resume.compare(ckpt, same, arch())}
    assert changes == {"trainer.seed", "rollout.seed"}
    # Unchanged: nothing to report.
    assert resume.compare(ckpt, Config.load(None, ["trainer.seed=1"]), arch()) == []


def test_a_saved_tree_resolves_like_a_config():
    tree = {"trainer": {"seed": 3}, "rollout": {"seed": None}, "data": {"seed": 9}}
    assert resolve_saved_seeds(tree) == {"trainer": {"seed": 3},
                                         "rollout": {"seed": stream_seed(3, "rollout")},
                                         "data": {"seed": 9}}
    assert resolve_saved_seeds({"data": {"seed": None}}) == {"data": {"seed": None}}
