"""model.make_tiny_if_missing (verl_mcore/tiny_model.py): the quickstart's model written on first
use, the very files `python -m tools.make_tiny_model` writes; atomic; one writer per node."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from verl_mcore.config import Config, ConfigError
from verl_mcore.tiny_model import QUICKSTART_PATH, ensure_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _model(path=QUICKSTART_PATH, make=True):
    return Config.load(None, [f"model.path={path}", f"model.make_tiny_if_missing={make}"]).model


@pytest.fixture
def quickstart_dir(tmp_path, monkeypatch):
    """The current directory, where QUICKSTART_PATH is: the only place the model is written."""
    monkeypatch.chdir(tmp_path)
    return tmp_path / QUICKSTART_PATH


def test_first_use_writes_the_same_model_as_the_tool(tmp_path, quickstart_dir):
    subprocess.run([sys.executable, "-m", "tools.make_tiny_model", "--out", str(tmp_path / "tool")],
                   cwd=ROOT, check=True, capture_output=True)
    ensure_tiny_model(_model(), local_rank=0)
    tool, auto = _files(tmp_path / "tool"), _files(quickstart_dir)
    assert "model.safetensors" in auto and "config.json" in auto and "tokenizer.json" in auto
    assert auto == tool
    assert sorted(os.listdir(quickstart_dir.parent)) == ["tiny_model"]  # no temporary left behind
    before = (quickstart_dir / "model.safetensors").stat().st_mtime_ns
    ensure_tiny_model(_model(quickstart_dir), local_rank=0)  # there (the same, absolute): used as it is
    assert (quickstart_dir / "model.safetensors").stat().st_mtime_ns == before


def test_only_the_quickstarts_path_is_written(tmp_path, quickstart_dir):
    """A config copied from the quickstart keeps make_tiny_if_missing: a mistyped model.path
    must stop the run, not train a random model there."""
    for path in (tmp_path / "models" / "Qwen2.5-7B", "runs/quickstart/tiny_modle", "org/name/x"):
        with pytest.raises(ConfigError, match=rf"model.path={path} holds no model .* only at the "
                                              rf"quickstart's own path {QUICKSTART_PATH}: set "
                                              r"model.path to your model's directory"):
            ensure_tiny_model(_model(path), local_rank=0)
    assert os.listdir(tmp_path) == []
    ensure_tiny_model(_model(tmp_path / "models", make=False), local_rank=0)  # off: not its business


def test_off_by_default_and_other_ranks_wait_for_local_rank_0(quickstart_dir):
    ensure_tiny_model(_model(make=False), local_rank=0)
    assert not quickstart_dir.exists()
    with pytest.raises(ConfigError, match=r"local rank 0 of this node did not write the tiny "
                                          r"model at model.path=.*/tiny_model within 0 s"):
        ensure_tiny_model(_model(), local_rank=1, timeout_s=0.0)
    waiter_error = []

    def waiter():
        try:
            ensure_tiny_model(_model(), local_rank=1, timeout_s=120)
        except ConfigError as e:
            waiter_error.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    ensure_tiny_model(_model(), local_rank=0)
    t.join(timeout=120)
    assert not t.is_alive() and not waiter_error
    assert (quickstart_dir / "config.json").is_file()


def test_a_failed_first_write_leaves_no_model_directory(quickstart_dir, monkeypatch):
    from verl_mcore import tiny_model

    def half_then_killed(out, **kwargs):
        Path(out, "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tiny_model, "make_tiny_model", half_then_killed)
    with pytest.raises(ConfigError, match="writing the tiny model to model.path=.*No space left"):
        ensure_tiny_model(_model(), local_rank=0)
    assert os.listdir(quickstart_dir.parent) == []


def test_errors_name_the_key(quickstart_dir):
    quickstart_dir.mkdir(parents=True)
    (quickstart_dir / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match="model.path=.*tiny_model exists but holds no config.json"):
        ensure_tiny_model(_model(), local_rank=0)
    with pytest.raises(ConfigError, match="make_tiny_if_missing=true needs model.path"):
        ensure_tiny_model(Config.load(None, ["model.make_tiny_if_missing=true"]).model, 0)


def test_a_hub_id_is_never_written_to(tmp_path, monkeypatch):
    """model.make_tiny_if_missing with model.path=org/name (the quickstart config with a Hub id
    override): the id is resolved from the Hub cache, and no ./org/name directory is made."""
    from types import SimpleNamespace

    from verl_mcore.tiny_model import ensure_tiny_model

    monkeypatch.chdir(tmp_path)
    ensure_tiny_model(SimpleNamespace(make_tiny_if_missing=True, path="org/tiny"), local_rank=0)
    assert not (tmp_path / "org").exists()
