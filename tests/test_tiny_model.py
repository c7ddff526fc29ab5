"""model.make_tiny_if_missing (verl_mcore/tiny_model.py): the quickstart's model written on first
use, the very files `python -m tools.make_tiny_model` writes; atomic; one writer per node."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from verl_mcore.config import Config, ConfigError
from verl_mcore.tiny_model import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _model(path, make=True):
    return Config.load(None, [f"model.path={path}", f"model.make_tiny_if_missing={make}"]).model


def test_first_use_writes_the_same_model_as_the_tool(tmp_path):
    subprocess.run([sys.executable, "-m", "tools.make_tiny_model", "--out", str(tmp_path / "tool")],
                   cwd=ROOT, check=True, capture_output=True)
    ensure_tiny_model(_model(tmp_path / "auto"), local_rank=0)
    tool, auto = _files(tmp_path / "tool"), _files(tmp_path / "auto")
    assert "model.safetensors" in auto and "config.json" in auto and "tokenizer.json" in auto
    assert auto == tool
    assert sorted(os.listdir(tmp_path)) == ["auto", "tool"]  # no temporary left behind
    before = (tmp_path / "auto" / "model.safetensors").stat().st_mtime_ns
    ensure_tiny_model(_model(tmp_path / "auto"), local_rank=0)  # there: used as it is
    assert (tmp_path / "auto" / "model.safetensors").stat().st_mtime_ns == before


def test_off_by_default_and_other_ranks_wait_for_local_rank_0(tmp_path, monkeypatch):
    ensure_tiny_model(_model(tmp_path / "m", make=False), local_rank=0)
    assert not (tmp_path / "m").exists()
    with pytest.raises(ConfigError, match=r"local rank 0 of this node did not write the tiny "
                                          r"model at model.path=.*/m within 0 s"):
        ensure_tiny_model(_model(tmp_path / "m"), local_rank=1, timeout_s=0.0)
    waiter_error = []

    def waiter():
        try:
            ensure_tiny_model(_model(tmp_path / "m"), local_rank=1, timeout_s=120)
        except ConfigError as e:
            waiter_error.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    ensure_tiny_model(_model(tmp_path / "m"), local_rank=0)
    t.join(timeout=120)
    assert not t.is_alive() and not waiter_error
    assert (tmp_path / "m" / "config.json").is_file()


def test_a_failed_first_write_leaves_no_model_directory(tmp_path, monkeypatch):
    from verl_mcore import tiny_model

    def half_then_killed(out, **kwargs):
        Path(out, "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tiny_model, "make_tiny_model", half_then_killed)
    with pytest.raises(ConfigError, match="writing the tiny model to model.path=.*No space left"):
        ensure_tiny_model(_model(tmp_path / "m"), local_rank=0)
    assert os.listdir(tmp_path) == []


def test_errors_name_the_key(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match="model.path=.*empty exists but holds no config.json"):
        ensure_tiny_model(_model(tmp_path / "empty"), local_rank=0)
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
