"""Careless input is refused before any model is built, naming the key or the file and what to do:
every numeric config field has a checked range, and the data files, the model directory
(config.json, the safetensors headers, the tokenizer) and the reward code are all read first, in
that order, the first problem of each kind reported together (issue 39)."""
import contextlib
import importlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import run_on_ranks
from verl_mcore import build
from verl_mcore.config import Config, ConfigError, ModelShape, validate
from verl_mcore.config.validate import RANGES, _Interval, numeric_fields, range_errors

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the range of every field

def test_every_numeric_field_has_a_range_entry():
    # A new int / float field in the schema fails here until RANGES says what is valid.
    assert sorted(numeric_fields()) == sorted(RANGES)


def test_the_defaults_are_in_range():
    assert range_errors(Config()) == []


def _outside(key: str) -> str:
    """A value just outside the range of `key`, as YAML."""
    interval = _Interval.parse(RANGES[key][0])
    if math.isinf(interval.low):
        return ".nan"
    low = int(interval.low) if interval.low == int(interval.low) else interval.low
    return str(low - 1 if interval.low_closed else low)


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_range_is_enforced_by_name(key):
    value = _outside(key)
    if key.startswith("reward.sources[]."):
        field = key.rsplit(".", 1)[1]
        override, written = f"reward.sources=[{{name: a, {field}: {value}}}]", f"reward.sources[0].{field}="
    elif key.startswith("rollout.agent_loop.tools[]."):
        field = key.rsplit(".", 1)[1]
        override = f"rollout.agent_loop.tools=[{{path: a.py, name: a, {field}: {value}}}]"
        written = f"rollout.agent_loop.tools[0].{field}="
    else:
        override, written = f"{key}={value}", f"{key}="
    with pytest.raises(ConfigError) as e:
        validate(Config.load(None, [override]), 1)
    assert written in str(e.value) and "must be" in str(e.value)


@pytest.mark.parametrize("override, message", [
    ("rollout.max_num_seqs=0", "rollout.max_num_seqs=0 must be >= 1"),
    ("actor.optim.lr=.nan", "actor.optim.lr=nan is not a finite number: it must be >= 0"),
    ("critic.optim.lr=.inf", "critic.optim.lr=inf is not a finite number: it must be >= 0"),
    ("actor.optim.lr=-0.1", "actor.optim.lr=-0.1 must be >= 0"),
    ("trainer.collective_timeout_s=-1", "trainer.collective_timeout_s=-1.0 must be > 0 (seconds)"),
    ("checkpoint.save_every=-1",
     "checkpoint.save_every=-1 must be >= 0 (0: only at the end and on preemption)"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last=-1 must be >= 0 (0: keep every checkpoint)"),
    ("reward.timeout_s=0", "reward.timeout_s=0.0 must be > 0 (seconds per sample"),
    ("reward.import_timeout_s=0", "reward.import_timeout_s=0.0 must be > 0"),
    ("reward.max_failed_fraction=1.5", "reward.max_failed_fraction=1.5 must be in [0, 1]"),
    ("reward.fallback_score=.nan", "reward.fallback_score=nan is not a finite number"),
    ("rollout.top_p=0", "rollout.top_p=0.0 must be in (0, 1]"),
])
def test_the_reported_cases_fail_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        validate(Config.load(None, [override]), 1)
    assert message in str(e.value)


def test_all_range_problems_are_listed_at_once():
    cfg = Config.load(None, ["rollout.max_num_seqs=0", "actor.optim.lr=.nan", "reward.timeout_s=0"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    assert str(e.value).count("\n  - ") == 3


@pytest.mark.parametrize("overrides, message", [
    (["actor.optim.lr=1e-6", "actor.optim.min_lr=1e-5"],
     "actor.optim.min_lr=1e-05 is above actor.optim.lr=1e-06"),
    (["reward.num_workers=0", "reward.max_memory_mb=512"],
     "reward.max_memory_mb=512 needs reward.num_workers >= 1"),
    (["trainer.collective_timeout_s=900", "data.read_timeout_s=900"],
     "data.read_timeout_s=900 must be below trainer.collective_timeout_s=900: the ranks that "
     "finished reading the data wait for the others"),
])
def test_cross_field_rules(overrides, message):
    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        validate(cfg, 1)


def test_responses_beyond_the_models_positions():
    shape = ModelShape(4, 2, 2, 40, 64, max_position_embeddings=128)
    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"),
                      ["data.max_prompt_length=100", "data.max_response_length=100"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1, shape)
    assert ("data.max_prompt_length + data.max_response_length = 100 + 100 = 200 tokens is more "
            "than the model's max_position_embeddings=128") in str(e.value)
    validate(Config.load(str(ROOT / "configs/quickstart.yaml"), []), 1, shape)  # 16 + 8 fits


def test_cli_refuses_nan_lr_before_starting():
    run = subprocess.run([sys.executable, "-m", "verl_mcore.train", "--config",
                          "configs/quickstart.yaml", "actor.optim.lr=.nan"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "config error" in run.stderr
    assert "actor.optim.lr=nan is not a finite number" in run.stderr
    assert "Traceback" not in run.stderr


# ------------------------------------------------------------------ model directory, data, reward

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return Path(make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model")))


@pytest.fixture
def model_dir(tiny_model, tmp_path):
    """A copy of the tiny model to break."""
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


def _cfg(model, *extra):
    return Config.load(str(ROOT / "configs/quickstart.yaml"), [
        f"model.path={model}", f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]",
        f"data.val_files=[{ROOT}/examples/data/quickstart_val.parquet]",
        f"reward.custom_fn.path={ROOT}/examples/quickstart_reward.py", "reward.num_workers=0",
        *extra])


def _input_error(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        build.build_inputs(cfg, 1)
    return str(e.value)


def test_good_inputs_pass(model_dir):
    inputs = build.build_inputs(_cfg(model_dir), 1)
    assert len(inputs.train_data) > 0 and inputs.val_data is not None
    inputs.rewards.close()


def test_group_filters_are_checked_with_the_inputs(model_dir, tmp_path):
    """rollout.group_filter's file and signature and algorithm.filter_groups' metric are checked
    by build_inputs before any model is built; the checked filters come with the inputs."""
    bad = tmp_path / "filters.py"
    bad.write_text("def keep(group, step):\n    return True\n")
    msg = _input_error(_cfg(model_dir, f"rollout.group_filter.path={bad}", "rollout.group_filter.name=keep"))
    assert f"rollout.group_filter.name='keep' in {bad}: keep(group, step) cannot be called" in msg
    msg = _input_error(_cfg(model_dir, "algorithm.filter_groups.enable=true",
                            "algorithm.filter_groups.metric=judge/acc"))
    assert "algorithm.filter_groups.metric='judge/acc' names no reward source (['rule'])" in msg
    inputs = build.build_inputs(_cfg(model_dir, "algorithm.filter_groups.enable=true",
                                     f"rollout.group_filter.path={ROOT}/examples/group_filter.py",
                                     "rollout.group_filter.name=drop_uninformative"), 1)
    inputs.rewards.close()
    builtin, user = inputs.group_filters.filters
    assert builtin.metric.key == "rule/acc" and user.name == "drop_uninformative"


def test_invalid_config_json(model_dir):
    (model_dir / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64,')
    msg = _input_error(_cfg(model_dir))
    assert f"{model_dir}/config.json is not valid JSON (line 1, column" in msg and "model.path" in msg


def test_config_json_missing_a_field(model_dir):
    hf = json.loads((model_dir / "config.json").read_text())
    del hf["intermediate_size"]
    (model_dir / "config.json").write_text(json.dumps(hf))
    assert "missing field(s) ['intermediate_size']" in _input_error(_cfg(model_dir))


def _weights(model_dir) -> Path:
    return model_dir / "model.safetensors"


@pytest.mark.parametrize("damage, problem", [
    (lambda data: data[:len(data) // 2], "ends at byte"),  # a cut download
    (lambda data: data[:5], "too short for a header"),
    (lambda data: (10**9).to_bytes(8, "little") + data[8:], "its header is 1000000000 bytes"),
    (lambda data: data[:8] + b"#" * 12 + data[20:], "its header does not parse"),
    (lambda data: data + b"\0" * 64, "the tensors cover"),
])
def test_damaged_safetensors_named_before_any_model(model_dir, damage, problem):
    path = _weights(model_dir)
    path.write_bytes(damage(path.read_bytes()))
    msg = _input_error(_cfg(model_dir))
    assert f"{path}: the safetensors file is incomplete or damaged" in msg and problem in msg


def test_sharded_weights_with_a_missing_shard(model_dir):
    names = list(json.loads(_weights(model_dir).read_bytes()[8:8 + int.from_bytes(
        _weights(model_dir).read_bytes()[:8], "little")]))
    _weights(model_dir).rename(model_dir / "model-00001-of-00002.safetensors")
    index = {"weight_map": {n: "model-00001-of-00002.safetensors" for n in names if n != "__metadata__"}}
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = _input_error(_cfg(model_dir))
    assert f"{model_dir}/model-00002-of-00002.safetensors: listed in" in msg and "missing" in msg


def test_no_weights_checked_when_a_dist_checkpoint_gives_them(model_dir, tmp_path):
    _weights(model_dir).write_bytes(b"")  # unused: model.checkpoint supplies the weights
    build.build_inputs(_cfg(model_dir, f"model.checkpoint={tmp_path}"), 1).rewards.close()


def test_missing_tokenizer_directory(model_dir, tmp_path):
    msg = _input_error(_cfg(model_dir, f"model.tokenizer={tmp_path}/no_such_dir"))
    assert f"model.tokenizer={tmp_path}/no_such_dir: no such directory" in msg
    (tmp_path / "empty").mkdir()
    msg = _input_error(_cfg(model_dir, f"model.tokenizer={tmp_path}/empty"))
    assert f"model.tokenizer={tmp_path}/empty: the tokenizer of this directory does not load" in msg


def test_data_errors_named(model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "repeat the digit 3 : ", "data_source": "x"}\n{"nope": 1}\n')
    msg = _input_error(_cfg(model_dir, f"data.train_files=[{bad}]"))
    assert str(bad) in msg and "row 1" in msg


def test_fewer_prompts_than_one_batch_named(model_dir, tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "repeat the digit 3 : ", "data_source": "x"}\n')
    msg = _input_error(_cfg(model_dir, f"data.train_files=[{one}]", "data.train_batch_size=4",
                            "actor.ppo_mini_batch_size=4"))
    assert "1 prompts after the data checks, fewer than one batch" in msg
    assert "data.train_batch_size=4" in msg


def test_prompt_too_long_named(model_dir):
    msg = _input_error(_cfg(model_dir, "data.max_prompt_length=2"))
    assert "more than data.max_prompt_length=2" in msg and "quickstart_train.parquet" in msg


# ------------------------------------------------------------------ the order of the checks

# Everything that makes or fetches a model, for the stand-ins that raise "built!".
MODEL_MAKERS = (("verl_mcore.build", "build_actor"), ("verl_mcore.build", "build_reference"),
                ("verl_mcore.build", "build_critic"), ("verl_mcore.build", "build_reward_models"),
                ("verl_mcore.tiny_model", "make_tiny_model"),
                ("huggingface_hub", "snapshot_download"))


@contextlib.contextmanager
def _no_model_made():
    """Each of MODEL_MAKERS replaced by a stand-in that records its name and raises 'built!' (a
    model that takes minutes to build or download), and put back after (ranks are pooled: later
    tests build models); yields the record."""
    made: list[str] = []
    saved = {}
    for module, name in MODEL_MAKERS:
        def stand_in(*args, _name=name, **kwargs):
            made.append(_name)
            raise AssertionError(f"built! ({_name})")

        owner = importlib.import_module(module)
        saved[owner, name] = getattr(owner, name)
        setattr(owner, name, stand_in)
    try:
        yield made
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def _cut_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:20])  # the 8-byte length and 12 bytes of the header


def _reward_model_weights(d: Path) -> None:
    """The directory holds a reward model (score, no lm_head), as when model.path names the
    reward model's directory by mistake."""
    from verl_mcore.tiny_model import make_tiny_model

    make_tiny_model(str(d), reward_model=True)


def _narrower_mlp_in_config(d: Path) -> None:
    hf = json.loads((d / "config.json").read_text())
    hf["intermediate_size"] //= 2  # config.json no longer describes the weights
    (d / "config.json").write_text(json.dumps(hf))


BROKEN = {  # how a model directory breaks -> what the message says
    "no config.json": (lambda d: (d / "config.json").unlink(), "holds no config.json"),
    "a cut safetensors header": (lambda d: _cut_header(d / "model.safetensors"),
                                 "model.safetensors: the safetensors file is incomplete"),
    # transformers then builds a tokenizer from config.json alone, which encodes text to nothing
    "no tokenizer files": (lambda d: [p.unlink() for p in d.glob("tokenizer*")],
                           "the tokenizer of this directory turns text into no tokens"),
    "a reward model's weights": (_reward_model_weights,
                                 "are not the weights of the causal LM config.json describes"),
    "weights of another shape": (_narrower_mlp_in_config, "tensors do not match config.json"),
}


@pytest.mark.parametrize("damage", BROKEN)
def test_a_broken_model_dir_and_a_missing_data_file_are_reported_together(model_dir, tmp_path,
                                                                         damage):
    breaks, problem = BROKEN[damage]
    breaks(model_dir)
    missing = tmp_path / "train.parquet"
    with _no_model_made() as made, pytest.raises(ConfigError) as e:
        build.build_inputs(_cfg(model_dir, "model.make_tiny_if_missing=false",
                                f"data.train_files=[{missing}]"), 1)
    message = str(e.value)
    assert message.startswith("the inputs have problems, the first of each kind:\n  - "
                              f"data.train_files: {missing}: no such file or directory\n  - ")
    assert problem in message and "model.path" in message
    assert made == []
    with _no_model_made() as made, pytest.raises(ConfigError, match=problem):  # alone
        build.build_inputs(_cfg(model_dir, "model.make_tiny_if_missing=false"), 1)
    assert made == []


def test_one_problem_of_each_kind_in_the_order_of_the_checks(model_dir, tmp_path):
    """Data, model, user code: each kind's first problem, in one message (a second data file
    missing and a second user file missing are not looked for)."""
    (model_dir / "config.json").unlink()
    missing = [tmp_path / f"{name}.parquet" for name in ("train", "val")]
    with _no_model_made() as made, pytest.raises(ConfigError) as e:
        build.build_inputs(_cfg(model_dir, "model.make_tiny_if_missing=false",
                                f"data.train_files=[{missing[0]}]",
                                f"data.val_files=[{missing[1]}]",
                                f"data.custom_cls.path={tmp_path}/my_dataset.py",
                                "data.custom_cls.name=MyDataset",
                                f"reward.custom_fn.path={tmp_path}/rewards.py"), 1)
    lines = str(e.value).splitlines()
    assert lines[0] == "the inputs have problems, the first of each kind:" and len(lines) == 4
    assert lines[1] == f"  - data.train_files: {missing[0]}: no such file or directory"
    assert lines[2].startswith(f"  - model.path={model_dir}: holds no config.json")
    assert lines[3].startswith(f"  - data.custom_cls.path='{tmp_path}/my_dataset.py': no such file")
    assert made == []


def test_the_data_is_checked_before_a_model_is_written_or_downloaded(tmp_path, monkeypatch):
    """The quickstart's tiny model still to write, or a Hub id not in the cache: a missing data
    file is reported without either, and so is a bad row the data check reads."""
    monkeypatch.chdir(tmp_path)
    missing, bad = tmp_path / "train.parquet", tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "repeat the digit 3 : "}\n{"prompt": ""}\n')
    for model in ("runs/quickstart/tiny_model", "org/a-70b-model"):
        for files, says in ((missing, f"data.train_files: {missing}: no such file or directory"),
                            (bad, f"data.train_files: {bad}, row 1, column 'prompt': the prompt "
                                  "is an empty string")):
            with _no_model_made() as made, pytest.raises(ConfigError) as e:
                build.build_inputs(_cfg(model, f"data.train_files=[{files}]"), 1)
            assert str(e.value) == says and made == []
    assert not (tmp_path / "runs").exists()


def _trainer_body(rank, world_size, cwd, overrides):
    """Trainer(cfg) in `cwd` with every model maker raising 'built!': (its error, what was made)."""
    import os

    from verl_mcore.trainer import Trainer

    before = os.getcwd()
    os.chdir(cwd)
    try:
        with _no_model_made() as made:
            Trainer(_cfg(*overrides))
    except Exception as e:  # noqa: BLE001 - the test reads what was raised
        return f"{type(e).__name__}: {e}", made
    finally:
        os.chdir(before)
    return None, made


def test_trainer_checks_the_data_before_building_models(model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 7}\n')
    [(msg, made)] = run_on_ranks(_trainer_body, 1, args=(str(tmp_path), [
        str(model_dir), f"data.train_files=[{bad}]", f"trainer.run_dir={tmp_path / 'run'}"]),
        timeout=300)
    assert str(bad) in msg and "row 0" in msg and made == []


def test_the_trainer_reports_a_missing_data_file_before_any_model_is_made(tmp_path):
    """`--config quickstart` with the tiny model not written yet, and a config of a Hub model not
    downloaded yet: a mistyped data file stops the Trainer before either model is made."""
    missing = tmp_path / "trian.parquet"
    for model in ("runs/quickstart/tiny_model", "org/a-70b-model"):
        [(error, made)] = run_on_ranks(_trainer_body, 1, args=(str(tmp_path), [
            model, f"data.train_files=[{missing}]",
            f"trainer.run_dir={tmp_path}/run_{model.replace('/', '_')}"]), timeout=300)
        assert error == f"ConfigError: data.train_files: {missing}: no such file or directory"
        assert made == []


def _agree_body(rank, world_size, files):
    try:
        with _no_model_made() as made:
            build.build_inputs(_cfg("org/a-70b-model", f"data.train_files=[{files[rank]}]"), world_size)
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return type(e).__name__, str(e), made
    return None


def test_a_data_file_missing_on_one_rank_stops_every_rank_before_the_download(tmp_path):
    """The download is collective: every rank must skip it alike, so the data verdict is agreed
    first (one rank's node lacks the file; the other rank must not wait for it in a download)."""
    missing = tmp_path / "only_on_the_other_node.parquet"
    results = run_on_ranks(_agree_body, 2, args=(
        [f"{ROOT}/examples/data/quickstart_train.parquet", str(missing)],), timeout=300)
    assert results[1] == ("ConfigError", f"data.train_files: {missing}: no such file or "
                                          "directory", [])
    assert results[0] == ("AgreedFailure", "rank 1 failed while checking the config and data: "
                          f"ConfigError: data.train_files: {missing}: no such file or directory",
                          [])
