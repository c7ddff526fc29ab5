"""Hugging Face Hub ids, without network: a cache laid out as huggingface_hub lays it out
(models--org--name/{refs,snapshots,blobs}, snapshot files symlinked into blobs/), read with
HF_HUB_OFFLINE=1. A Hub id resolves to its snapshot for model.path, model.tokenizer and a reward
model's path, `revision` picks another commit, the input checks and the planner accept the id,
and an id with no cached copy fails naming the id, the cache and what to set."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from verl_mcore import build
from verl_mcore.config import Config, ConfigError, validate
from verl_mcore.models import hub

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = "a" * 40  # commit hashes: 40 hex digits, as the Hub's
OLD = "b" * 40


def add_snapshot(cache: str, repo_id: str, commit: str, src: str, ref: str | None = "main") -> str:
    """Put the files of `src` into `cache` as snapshot `commit` of `repo_id`, each a relative
    symlink into blobs/ named by its sha256 (huggingface_hub's layout); `ref` -> `commit`."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f:
            data = f.read()
        blob = hashlib.sha256(data).hexdigest()
        with open(os.path.join(repo, "blobs", blob), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    if ref:
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """HF_HOME with org/tiny (main and an older commit of 3 layers) and org/tiny-rm."""
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("hub")
    cache = str(root / "home" / "hub")
    add_snapshot(cache, "org/tiny", MAIN, make_tiny_model(str(root / "tiny")))
    add_snapshot(cache, "org/tiny", OLD, make_tiny_model(str(root / "tiny3"), layers=3), ref=None)
    add_snapshot(cache, "org/tiny-rm", MAIN,
                 make_tiny_model(str(root / "rm"), seed=1, reward_model=True))
    return str(root / "home")


@pytest.fixture
def offline(hf_home, monkeypatch):
    """huggingface_hub read its environment when it was imported: set the values it took
    from HF_HOME and HF_HUB_OFFLINE=1 (the subprocess test below sets the variables)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", os.path.join(hf_home, "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "_resolved", {})
    return os.path.join(hf_home, "hub")


def _config(*overrides):
    return Config.load(os.path.join(ROOT, "configs/quickstart.yaml"), [
        "data.max_prompt_length=16", "data.max_response_length=16", *overrides])


def test_a_hub_id_is_its_cached_snapshot(offline):
    snapshot = os.path.join(offline, "models--org--tiny", "snapshots", MAIN)
    assert hub.local_dir("org/tiny") == snapshot
    assert hub.local_dir("org/tiny", OLD) == os.path.join(os.path.dirname(snapshot), OLD)


def test_paths_are_never_looked_up(offline, tmp_path, monkeypatch):
    for path in ["/no/such", "./org/tiny", "../tiny", "~/tiny", "tiny", "a/b/c"]:
        assert not hub.is_hub_id(path) and hub.local_dir(path) == path
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # a local directory named like an id wins, as in transformers
    assert hub.local_dir("org/tiny") == "org/tiny"


def test_model_path_tokenizer_and_reward_model_accept_hub_ids(offline):
    cfg = _config("model.path=org/tiny", "model.tokenizer=org/tiny-rm",
                  "reward.sources=[{name: rm, type: reward_model, path: org/tiny-rm}]")
    validate(cfg, 1)
    info = build.load_model_info(cfg)
    assert info.hf_dir == os.path.join(offline, "models--org--tiny", "snapshots", MAIN)
    assert info.arch.num_layers == 2
    assert info.tokenizer.name_or_path.startswith(os.path.join(offline, "models--org--tiny-rm"))
    key, source = build.reward_model_sources(cfg)[0]
    rm = build.reward_model_info(cfg, key, source)
    assert rm.hf_dir.startswith(os.path.join(offline, "models--org--tiny-rm", "snapshots"))
    assert cfg.model.path == "org/tiny"  # the config (config.yaml, checkpoints) keeps the id


def test_revision_picks_another_commit(offline):
    cfg = _config("model.path=org/tiny", f"model.revision={OLD}")
    info = build.load_model_info(cfg)
    assert info.arch.num_layers == 3 and info.hf_dir.endswith(OLD)


def test_build_inputs_and_the_planner_accept_the_id(offline):
    from verl_mcore.planning.memory import resolve_dims, reward_model_dims

    cfg = _config("model.path=org/tiny", "reward.num_workers=0",
                  "reward.sources=[{name: rm, type: reward_model, path: org/tiny-rm}]")
    inputs = build.build_inputs(cfg, 1)
    try:
        assert inputs.info.hf_dir.endswith(MAIN) and len(inputs.train_data) > 0
    finally:
        inputs.rewards.close()
    assert resolve_dims("org/tiny").num_layers == 2
    assert resolve_dims("org/tiny", OLD).num_layers == 3
    assert set(reward_model_dims(cfg)) == {"rm"}


def test_offline_without_a_copy_names_the_id_the_cache_and_what_to_do(offline):
    cfg = _config("model.path=org/absent")
    with pytest.raises(ConfigError) as e:
        build.load_model_info(cfg)
    message = str(e.value)
    assert "model.path=org/absent" in message and offline in message
    assert "hf download org/absent" in message and "HF_HOME" in message
    assert "HF_HUB_OFFLINE is set" in message
    cfg = _config("model.path=org/tiny", "model.revision=v9")  # a ref that is not cached
    with pytest.raises(ConfigError, match="revision 'v9'.*hf download org/tiny --revision v9"):
        build.load_model_info(cfg)
    cfg = _config("reward.sources=[{name: rm, type: reward_model, path: org/absent-rm}]")
    key, source = build.reward_model_sources(cfg)[0]
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].path=org/absent-rm"):
        build.reward_model_info(cfg, key, source)


@pytest.fixture
def own_cache(offline, tmp_path, monkeypatch):
    """An empty cache of this test's own (offline as `offline`), for copies it damages."""
    from huggingface_hub import constants

    cache = str(tmp_path / "hub")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    return cache


def _cut(path, keep=10):
    """Truncate the blob a snapshot file links to (what an interrupted download leaves)."""
    blob = os.path.realpath(path)
    with open(blob, "rb") as f:
        data = f.read()
    with open(blob, "wb") as f:
        f.write(data[:keep])


@pytest.mark.parametrize("damage", [
    lambda snap: _cut(os.path.join(snap, "config.json")),
    lambda snap: os.remove(os.path.realpath(os.path.join(snap, "config.json"))),  # blob gone
    lambda snap: _cut(os.path.join(snap, "model.safetensors"), keep=100),
    lambda snap: os.remove(os.path.join(snap, "model.safetensors")),
    lambda snap: _cut(os.path.join(snap, "tokenizer.json")),
], ids=["config.json cut", "config.json blob missing", "safetensors cut", "safetensors missing",
        "tokenizer.json cut"])
def test_a_damaged_cached_copy_says_how_to_download_it_again(own_cache, tmp_path, damage):
    from tools.make_tiny_model import make_tiny_model

    snapshot = add_snapshot(own_cache, "org/damaged", MAIN, make_tiny_model(str(tmp_path / "m")))
    damage(snapshot)
    with pytest.raises(ConfigError) as e:
        build.build_inputs(_config("model.path=org/damaged", "reward.num_workers=0"), 1)
    message = str(e.value)
    assert snapshot in message, message  # the cached path
    assert (f"It is in the Hugging Face cache (snapshot {MAIN} of org/damaged), so the copy is "
            f"damaged or incomplete") in message, message
    assert f"hf download org/damaged --revision {MAIN} --force-download" in message
    assert f"or delete {os.path.join(own_cache, 'models--org--damaged')} and start again" in message
    assert "HF_HUB_OFFLINE unset" in message


def test_a_damaged_cached_reward_model_and_other_paths(own_cache, tmp_path):
    from tools.make_tiny_model import make_tiny_model

    snapshot = add_snapshot(own_cache, "org/damaged-rm", MAIN,
                            make_tiny_model(str(tmp_path / "rm"), seed=1, reward_model=True))
    _cut(os.path.join(snapshot, "config.json"))
    cfg = _config("reward.sources=[{name: rm, type: reward_model, path: org/damaged-rm}]")
    key, source = build.reward_model_sources(cfg)[0]
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].path=org/damaged-rm: .*config.json "
                                          r"is not valid JSON.*hf download org/damaged-rm "):
        build.reward_model_info(cfg, key, source)
    # a directory outside the cache gets no such advice
    assert hub.cache_advice(str(tmp_path / "rm" / "config.json")) == ""
    assert hub.cache_advice(None) == ""


def test_a_missing_local_directory_is_still_no_such_directory(offline):
    with pytest.raises(ConfigError, match="model.tokenizer=./no/tok: no such directory"):
        build.load_model_info(_config("model.path=org/tiny", "model.tokenizer=./no/tok"))
    cfg = _config("reward.sources=[{name: rm, type: reward_model, path: /no/rm}]")
    key, source = build.reward_model_sources(cfg)[0]
    with pytest.raises(ConfigError, match=r"path=/no/rm: no such directory"):
        build.reward_model_info(cfg, key, source)


def test_a_revision_without_a_hub_id_is_refused(offline, tmp_path):
    with pytest.raises(ConfigError, match="model.revision=v1 .* is not one"):
        validate(_config(f"model.path={tmp_path}", "model.revision=v1"), 1)
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].revision=v1"):
        validate(_config("model.path=org/tiny", "reward.sources=[{name: rm, type: reward_model, "
                         f"path: {tmp_path}, revision: v1}}]"), 1)


def test_the_environment_is_honoured_by_the_planner_and_the_converter(hf_home, tmp_path):
    """HF_HOME and HF_HUB_OFFLINE as a user sets them, in fresh interpreters."""
    env = dict(os.environ, HF_HOME=hf_home, HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    plan = subprocess.run([sys.executable, "-m", "verl_mcore.plan", "--config",
                           "configs/quickstart.yaml", "model.path=org/tiny",
                           f"model.revision={OLD}", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert '"num_layers": 3' in plan.stdout.replace("\n", " ") or "3 layers" in plan.stdout
    convert = subprocess.run([sys.executable, "-m", "tools.convert_hf", "hf-to-mcore", "--hf",
                              "org/absent", "--out", str(tmp_path / "ckpt")],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert convert.returncode == 2 and "--hf=org/absent" in convert.stderr
    assert os.path.join(hf_home, "hub") in convert.stderr


@pytest.mark.slow
def test_one_training_step_from_a_hub_id(hf_home, tmp_path):
    """The trainer's own entry point, offline, model.path an id: the checks, the models and one
    GRPO step read the cached snapshot; RUN_DIR/config.yaml keeps the id."""
    env = dict(os.environ, HF_HOME=hf_home, HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    run = subprocess.run([sys.executable, "-m", "verl_mcore.train", "--config",
                          "configs/quickstart.yaml", "model.path=org/tiny",
                          f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=1",
                          "trainer.val_every=0", "trainer.val_before_train=false",
                          "checkpoint.save_every=0"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "run finished: 1 step" in run.stdout
    with open(tmp_path / "run" / "config.yaml") as f:
        assert "path: org/tiny" in f.read()


def _fetch_on_ranks(rank, world_size, cache):
    """fetch_for_run on every rank: who went to the Hub, what each found, and a missing id."""
    import huggingface_hub
    from huggingface_hub import constants

    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = cache, True  # a fresh pool: not reused
    online_calls = []
    download = huggingface_hub.snapshot_download

    def recording(*args, local_files_only=False, **kwargs):
        if not local_files_only:
            online_calls.append(args[0])
        return download(*args, local_files_only=local_files_only, **kwargs)

    huggingface_hub.snapshot_download = recording
    build.fetch_for_run(_config("model.path=org/tiny"))
    found = hub.local_dir("org/tiny")
    try:
        build.fetch_for_run(_config("model.path=org/absent"))
        failure = None
    except Exception as e:  # noqa: BLE001 - returned to the test to read
        failure = f"{type(e).__name__}: {e}"
    return online_calls, found, failure


def test_local_rank_0_downloads_the_others_wait_and_a_failure_stops_every_rank(offline):
    from tests.multiproc import run_on_ranks

    (calls0, found0, fail0), (calls1, found1, fail1) = run_on_ranks(
        _fetch_on_ranks, world_size=2, args=(offline,), timeout=240, fresh=True)
    assert calls0 == ["org/tiny", "org/absent"] and calls1 == []
    assert found0 == found1 and found0.endswith(MAIN)
    assert fail0.startswith("ConfigError: model.path=org/absent")
    assert fail1.startswith("AgreedFailure: rank 0 failed while downloading model.path=org/absent")


def test_invalid_ids_and_mistyped_directories_are_named(offline, tmp_path, monkeypatch):
    """`org/ti ny` and `org/` are no id the Hub accepts: a ConfigError naming the key, not
    huggingface_hub's HFValidationError; `runs/tiny_modle` under an existing `runs/` is a
    mistyped directory, not an id."""
    for bad in ("org/ti ny", "org/"):
        with pytest.raises(ConfigError, match=r"model.path=org/.*neither a local directory nor a "
                                              r"valid Hugging Face Hub id"):
            hub.local_dir(bad, key="model.path")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert not hub.is_hub_id("runs/tiny_modle") and hub.is_hub_id("org/tiny")
