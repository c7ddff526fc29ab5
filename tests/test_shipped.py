"""verl_mcore/shipped.py: `--config NAME` finds a shipped config, and a shipped config's relative
input paths are found among the shipped files when they are not in the current directory."""
from pathlib import Path

import pytest

from verl_mcore.config import Config, ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_a_bare_name_is_the_shipped_config_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = Config.load("quickstart")
    assert cfg.model.make_tiny_if_missing and cfg.model.path == "runs/quickstart/tiny_model"
    from verl_mcore.tiny_model import QUICKSTART_PATH

    assert cfg.model.path == QUICKSTART_PATH  # the one path the tiny model is written to
    assert cfg.data.train_files == [str(ROOT / "examples/data/quickstart_train.parquet")]
    assert cfg.data.val_files == [str(ROOT / "examples/data/quickstart_val.parquet")]
    assert cfg.reward.custom_fn.path == str(ROOT / "examples/quickstart_reward.py")
    assert Config.load("quickstart.yaml").data.train_files == cfg.data.train_files
    with pytest.raises(ConfigError, match=r"--config quickstrat: no such file here, and no "
                                          r"shipped config of that name \(shipped: .*quickstart"):
        Config.load("quickstrat")


def test_paths_in_the_current_directory_win_and_unknown_ones_stay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "quickstart_reward.py").write_text("")
    cfg = Config.load("quickstart", ["data.val_files=[examples/data/mine.parquet]"])
    assert cfg.reward.custom_fn.path == "examples/quickstart_reward.py"  # the user's copy
    assert cfg.data.val_files == ["examples/data/mine.parquet"]  # left for the usual error
    assert cfg.data.train_files == [str(ROOT / "examples/data/quickstart_train.parquet")]
