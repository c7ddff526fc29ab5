import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from verl_mcore.config import Config, ConfigError, ModelShape, validate

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str) -> Config:
    base = ["model.path=/m", "data.train_files=[a.parquet]"]
    return Config.load(None, base + list(overrides))


def test_overrides_parse_yaml_values():
    cfg = Config.load(None, ["trainer.logger=[console,jsonl]", "actor.optim.lr=1e-5",
                             "rollout.n=8", "actor.use_kl_loss=true", "model.path=null",
                             "data.train_files=x.parquet"])
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.actor.optim.lr == pytest.approx(1e-5)
    assert cfg.rollout.n == 8 and cfg.actor.use_kl_loss is True and cfg.model.path is None
    assert cfg.data.train_files == ["x.parquet"]


def test_yaml_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  total_steps: 7\nrollout:\n  n: 2\n")
    cfg = Config.load(str(f), ["rollout.n=4"])
    assert cfg.trainer.total_steps == 7 and cfg.rollout.n == 4


@pytest.mark.parametrize("override, expected", [
    ("trainer.totl_steps=3", "did you mean trainer.total_steps?"),
    ("actor.lr=1", "did you mean actor.optim.lr?"),
    ("tensor_model_parallel_size=2", "did you mean parallel.tensor_model_parallel_size?"),
    ("rollout.tensor_parallel_sze=2", "did you mean rollout.tensor_parallel_size?"),
])
def test_unknown_key_names_closest(override, expected):
    with pytest.raises(ConfigError, match="unknown config key") as e:
        Config.load(None, [override])
    assert expected in str(e.value)


@pytest.mark.parametrize("override, fragment", [
    ("trainer.total_steps=abc", "trainer.total_steps: expected int, got 'abc'"),
    ("trainer.total_steps=1.5", "trainer.total_steps: expected int, got 1.5"),
    ("actor.use_kl_loss=maybe", "actor.use_kl_loss: expected bool"),
    ("algorithm.adv_estimator=grpoo", "did you mean 'grpo'"),
    ("trainer.logger=5", "trainer.logger: expected list[str], got 5"),
    ("actor.optim=3", "actor.optim: expected a mapping"),
    ("reward.math_compat=strict", "reward.math_compat"),
])
def test_wrong_type_names_key_type_value(override, fragment):
    with pytest.raises(ConfigError) as e:
        Config.load(None, [override])
    assert fragment in str(e.value)


def test_malformed_override():
    with pytest.raises(ConfigError, match="a.b.c=value"):
        Config.load(None, ["trainer.total_steps"])


def test_a_partial_section_keeps_that_sections_own_defaults():
    # critic.optim defaults to lr 1e-5 (not OptimConfig's 1e-6): setting another of its keys
    # must not reset it.
    cfg = Config.load(None, ["critic.optim.clip_grad=0.5"])
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.optim.clip_grad == 0.5
    assert Config.load(None, ["critic.optim.lr=3e-5"]).critic.optim.lr == 3e-5
    assert Config.load(None, ["actor.optim.clip_grad=0.5"]).actor.optim.lr == 1e-6


def test_yaml_round_trip():
    cfg = _cfg("rollout.n=3", "reward.routes={math: lighteval/MATH}")
    again = Config.load(None, [])
    from verl_mcore.config.loading import from_dict
    again = from_dict(Config, yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


@pytest.mark.parametrize("world, overrides, fragments", [
    (6, ["parallel.tensor_model_parallel_size=4"], ["world size 6 is not divisible by TP×PP×CP"]),
    (8, ["parallel.tensor_model_parallel_size=2", "rollout.tensor_parallel_size=4"],
     ["rollout.tensor_parallel_size=4 must divide parallel.tensor_model_parallel_size=2"]),
    (4, ["data.train_batch_size=6", "actor.ppo_mini_batch_size=4"],
     ["data.train_batch_size=6 is not divisible by actor.ppo_mini_batch_size=4"]),
    (4, ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=2",
         "actor.micro_batch_size_per_gpu=3"], ["actor.micro_batch_size_per_gpu=3"]),
    (1, ["data.max_prompt_length=0"], ["data.max_prompt_length=0 must be >= 1"]),
    (1, ["model.make_vocab_size_divisible_by=0"], ["model.make_vocab_size_divisible_by=0 must be >= 1"]),
    (1, ["rollout.n=1", "algorithm.adv_estimator=grpo"], ["set rollout.n >= 2"]),
    (1, ["actor.max_tokens_per_microbatch=100", "data.max_prompt_length=64",
         "data.max_response_length=64"], ["actor.max_tokens_per_microbatch=100 is smaller"]),
    (1, ["trainer.logger=[console,graphite]"], ["unknown tracker(s) ['graphite']"]),
    (1, ["rollout.logprob_check.max_new_tokens=-1"], ["rollout.logprob_check.max_new_tokens=-1 must be >= 0"]),
    (1, ["rollout.engine=vllm"], ["pip install vllm"]),
    (2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
         "data.train_batch_size=2", "actor.ppo_mini_batch_size=2"], ["needs TransformerEngine"]),
    (1, ["algorithm.adv_estimator=gae", "critic.micro_batch_size_per_gpu=0"],
     ["critic.micro_batch_size_per_gpu=0 must be >= 1"]),
    (1, ["algorithm.adv_estimator=gae", "critic.ppo_epochs=0"], ["critic.ppo_epochs=0 must be >= 1"]),
    (1, ["data.val_files=[v.parquet]", "data.val_batch_size=0"], ["data.val_batch_size=0 must be >= 1"]),
    (1, ["trainer.val_every=5"], ["trainer.val_every=5 but data.val_files is empty"]),
    (1, ["trainer.val_before_train=true"], ["trainer.val_before_train=true but data.val_files is empty"]),
    (1, ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"],
     ["algorithm.kl_ctrl.horizon=0 must be >= 1"]),
    (1, ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"], ["algorithm.kl_ctrl.target_kl=0.0 must be > 0"]),
    (1, ["algorithm.kl_ctrl.kl_coef=-0.1"], ["algorithm.kl_ctrl.kl_coef=-0.1 must be >= 0"]),
    (1, ["reward.overlong_buffer.enable=true"],
     ["reward.overlong_buffer.enable=true needs reward.overlong_buffer.len",
      "below data.max_response_length=512"]),
    (1, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=64",
         "data.max_response_length=64"],
     ["reward.overlong_buffer.len=64 must be below data.max_response_length=64"]),
    (1, ["reward.overlong_buffer.len=0"], ["reward.overlong_buffer.len=0 must be >= 1"]),
    (1, ["reward.overlong_buffer.penalty_factor=-0.5"],
     ["reward.overlong_buffer.penalty_factor=-0.5 must be >= 0"]),
    # 1e12 samples: refused before any model is built, not a MemoryError in step 1.
    (1, ["rollout.n=1000000000000", "actor.ppo_mini_batch_size=8", "data.train_batch_size=8"],
     ["rollout.n=1000000000000 samples", "GiB on every rank, more than this machine's"]),
])
def test_cross_field_checks_name_fields(world, overrides, fragments):
    cfg = _cfg("rollout.n=2", *overrides)
    import importlib.util

    for needed, key in [("vllm", "rollout.engine=vllm"),
                        ("transformer_engine", "parallel.sequence_parallel=true")]:
        if key in overrides and importlib.util.find_spec(needed) is not None:
            pytest.skip(f"{needed} is installed here")
    with pytest.raises(ConfigError) as e:
        validate(cfg, world)
    for fragment in fragments:
        assert fragment in str(e.value)


def test_model_shape_checks():
    shape = ModelShape(num_attention_heads=12, num_key_value_heads=2, num_layers=6,
                       vocab_size=100, hidden_size=96)
    cfg = _cfg("rollout.n=2", "parallel.tensor_model_parallel_size=8",
               "parallel.pipeline_model_parallel_size=4", "data.train_batch_size=1",
               "actor.ppo_mini_batch_size=1", "actor.micro_batch_size_per_gpu=1")
    with pytest.raises(ConfigError) as e:
        validate(cfg, 32, shape)
    msg = str(e.value)
    assert "12 attention heads, not divisible by parallel.tensor_model_parallel_size=8" in msg
    assert "6 layers, not divisible by PP×VPP = 4" in msg


@pytest.mark.parametrize("overrides,tied,fragment", [
    (["actor.lora.target_modules=[qproj]"], False, "actor.lora.target_modules: ['qproj'] not among"),
    (["actor.lora.target_modules=[all-linear,q_proj]"], False, "drop the others (['q_proj'])"),
    (["actor.lora.target_modules=[all-linear,lm_head]"], True, "lm_head is tied to embed_tokens"),
    (["algorithm.adv_estimator=gae", "critic.lora.enable=true",
      "critic.lora.target_modules=[lm_head]"], False, "the critic's output layer is its value head"),
    (["actor.lora.init_from=/nowhere"], False, "no adapter_config.json there"),
    (["reference.offload_params=true"], False, "the actor's own model (nothing of its own"),
])
def test_lora_settings_that_cannot_run_are_refused_before_any_model(overrides, tied, fragment):
    shape = ModelShape(num_attention_heads=4, num_key_value_heads=2, num_layers=2,
                       vocab_size=100, hidden_size=64, tie_word_embeddings=tied)
    cfg = _cfg("rollout.n=2", "actor.lora.enable=true", "actor.use_kl_loss=true", *overrides)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        validate(cfg, 1, shape, data_files=False)


def test_lm_head_as_a_lora_target_passes_on_an_untied_model():
    shape = ModelShape(num_attention_heads=4, num_key_value_heads=2, num_layers=2,
                       vocab_size=100, hidden_size=64, tie_word_embeddings=False)
    validate(_cfg("rollout.n=2", "actor.lora.enable=true",
                  "actor.lora.target_modules=[all-linear,lm_head]"), 1, shape, data_files=False)


def test_math_compat_math_verify_without_the_package_names_it(monkeypatch):
    """reward.math_compat=math_verify is refused at validation when math-verify is missing."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "math_verify" else real(name, *a))
    validate(_cfg("rollout.n=2"), 1)
    with pytest.raises(ConfigError, match=r"reward.math_compat=math_verify but math_verify is not "
                                          r"installed: pip install 'verl_mcore\[math\]'"):
        validate(_cfg("rollout.n=2", "reward.math_compat=math_verify"), 1)
    assert _cfg("reward.math_compat=lenient").reward.math_compat == "lenient"


def test_valid_config_passes():
    cfg = _cfg("rollout.n=4", "parallel.tensor_model_parallel_size=2",
               "parallel.pipeline_model_parallel_size=2", "rollout.tensor_parallel_size=2",
               "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
               "actor.micro_batch_size_per_gpu=2")
    validate(cfg, 8)


def test_an_overlong_buffer_below_the_response_length_passes():
    validate(_cfg("rollout.n=2", "data.max_response_length=64",
                  "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=63",
                  "reward.overlong_buffer.penalty_factor=0"), 1)


def test_the_python_api_checks_leave_out_files_lengths_and_batches():
    """validate's data_files / lengths / batches switches (the Python API's objects know the
    lengths and batch sizes at different times): each leaves out its rules and only those."""
    shape = ModelShape(num_attention_heads=4, num_key_value_heads=2, num_layers=2,
                       vocab_size=100, hidden_size=64, max_position_embeddings=128)
    cfg = Config.load(None, ["model.path=m", "data.train_batch_size=3",
                             "actor.ppo_mini_batch_size=2", "actor.max_tokens_per_microbatch=64"])
    rules = {"data_files": ["data.train_files is empty"],
             "lengths": ["1024 tokens is more than", "smaller than one full sequence"],
             "batches": ["not divisible by actor.ppo_mini_batch_size=2"]}
    validate(cfg, 1, shape, data_files=False, lengths=False, batches=False)
    for on in rules:  # that switch alone: its rules and no other
        with pytest.raises(ConfigError) as e:
            validate(cfg, 1, shape, **{k: k == on for k in rules})
        for switch, fragments in rules.items():
            for fragment in fragments:
                assert (fragment in str(e.value)) == (switch == on), (on, fragment)
    with pytest.raises(ConfigError, match="world size 1 is not divisible by TP"):
        validate(Config.load(None, ["model.path=m", "parallel.tensor_model_parallel_size=2"]), 1,
                 data_files=False, lengths=False, batches=False)


def _run_train(*args):
    return subprocess.run([sys.executable, "-m", "verl_mcore.train", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_print_config_and_typo():
    ok = _run_train("--config", "configs/quickstart.yaml", "--print-config", "rollout.n=3")
    assert ok.returncode == 0, ok.stderr
    printed = yaml.safe_load(ok.stdout)
    assert printed["rollout"]["n"] == 3 and printed["algorithm"]["adv_estimator"] == "grpo"
    bad = _run_train("--config", "configs/quickstart.yaml", "trainer.totl_steps=3")
    assert bad.returncode != 0
    assert "trainer.total_steps" in bad.stderr


def test_every_shipped_config_loads():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        Config.load(str(path), [])
