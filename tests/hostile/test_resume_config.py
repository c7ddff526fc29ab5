"""A resume with a changed config (verl_mcore/config/resume.py): the config's values apply, with a
line per key, the checkpoint's step counters are kept, and what cannot change is refused by name
before any weight is read, leaving the checkpoints and metrics as they were."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from tests.e2e.test_trainer import ROOT, _overrides
from tests.engine.common import arch
from tests.multiproc import run_on_ranks
from verl_mcore.config import Config
from verl_mcore.config import resume
from verl_mcore.config.seeds import stream_seed
from verl_mcore.data.loader import PromptLoader


def _saved(tmp_path, cfg, saved_arch=None):
    path = tmp_path / "step_00000004"
    path.mkdir()
    for name, text in resume.checkpoint_files(cfg, saved_arch or arch()).items():
        (path / name).write_text(text)
    return str(path)


def test_changes_are_listed_key_by_key(tmp_path):
    base = Config.load(None, ["model.path=/models/a", "actor.optim.lr=0.003"])
    ckpt = _saved(tmp_path, base)
    cfg = Config.load(None, ["model.path=/models/moved", "actor.optim.lr=0.0001",
                             "critic.optim.clip_grad=0.5", "algorithm.kl_ctrl.kl_coef=0.2",
                             "parallel.tensor_model_parallel_size=2",
                             "reward.routes={gsm8k: rule}"])
    changes = {c.key: c for c in resume.compare(ckpt, cfg, arch())}
    assert str(changes["actor.optim.lr"]) == "actor.optim.lr: 0.003 in the checkpoint -> 0.0001 from the config"
    assert set(changes) == {"model.path", "actor.optim.lr", "critic.optim.clip_grad",
                            "algorithm.kl_ctrl.kl_coef", "parallel.tensor_model_parallel_size",
                            "reward.routes"}
    state = resume.apply_to_state(list(changes.values()), {"kl_ctrl": {"value": 0.5}, "loader": {}},
                                 PromptLoader.rebatch)
    assert state["kl_ctrl"] is None  # starts afresh at the config's coefficient


def test_what_cannot_change_is_refused_by_name(tmp_path):
    ckpt = _saved(tmp_path, Config.load(None, ["model.path=/models/a", "algorithm.adv_estimator=grpo"]))
    cfg = Config.load(None, ["model.path=/models/a", "model.make_vocab_size_divisible_by=100",
                             "algorithm.adv_estimator=gae", "data.seed=5",
                             "parallel.use_distributed_optimizer=false"])
    with pytest.raises(resume.ResumeConfigError) as e:
        resume.compare(ckpt, cfg, arch())
    message = str(e.value)
    assert f"cannot resume from {ckpt} with this config" in message
    assert "the vocabulary is padded to 200 rows" in message and "embedding has 128" in message
    assert "algorithm.adv_estimator: 'grpo' in the checkpoint -> 'gae'" in message
    assert "no critic" in message
    # The checkpoint's data.seed was null: the one it drew from is derived from trainer.seed.
    drawn = stream_seed(42, "data")
    assert f"data.seed: {drawn} in the checkpoint -> 5" in message
    assert f"set data.seed={drawn} again" in message
    assert "parallel.use_distributed_optimizer=True again" in message

    other = dataclasses.replace(arch(), hidden_size=128, num_layers=8)
    with pytest.raises(resume.ResumeConfigError) as e:
        resume.compare(ckpt, Config.load(None, ["model.path=/models/b"]), other)
    assert "another architecture than the checkpoint's (hidden_size 64 -> 128, num_layers 4 -> 8)" in str(e.value)
    assert "the checkpoint's model.path was /models/a" in str(e.value)


def test_lora_shape_changes_are_refused_before_any_weight_is_read(tmp_path):
    """Another actor.lora.r failed in megatron's load (CheckpointingException) after half the
    roles had loaded; now each LoRA key is refused by name."""
    lora = ["actor.lora.enable=true", "critic.lora.enable=true", "algorithm.adv_estimator=gae"]
    ckpt = _saved(tmp_path, Config.load(None, lora))
    cfg = Config.load(None, lora + ["actor.lora.r=4", "actor.lora.alpha=8",
                                    "critic.lora.target_modules=[q_proj]",
                                    "actor.lora.dropout=0.1", "actor.lora.lr=0.001"])
    with pytest.raises(resume.ResumeConfigError) as e:
        resume.compare(ckpt, cfg, arch())
    message = str(e.value)
    assert "actor.lora.r: 8 in the checkpoint -> 4 from the config" in message
    assert "trained with actor.lora.r=8" in message
    assert "actor.lora.alpha: 16.0 in the checkpoint -> 8.0" in message
    assert "critic.lora.target_modules: ['all-linear'] in the checkpoint -> ['q_proj']" in message
    assert "dropout" not in message and "lora.lr" not in message  # these may change
    # Without LoRA in the checkpoint the adapter settings describe nothing that was saved.
    (tmp_path / "plain").mkdir()
    plain = _saved(tmp_path / "plain", Config.load(None, []))
    changes = resume.compare(plain, Config.load(None, ["actor.lora.r=4"]), arch())
    assert [c.key for c in changes] == ["actor.lora.r"]


def test_a_checkpoint_without_a_record_resumes_as_before(tmp_path):
    (tmp_path / "step_00000001").mkdir()
    assert resume.compare(str(tmp_path / "step_00000001"), Config(), arch()) == []


def test_prompt_loader_keeps_its_place_when_the_batch_size_changes():
    state = {"epoch": 2, "batch_in_epoch": 3, "batch_size": 8, "seed": 1}
    assert PromptLoader.rebatch(state, 4) == dict(state, batch_in_epoch=6, batch_size=4)
    # 24 prompts done; batches of 16: batch 1 starts at prompt 16, so 8 are handed out again.
    assert PromptLoader.rebatch(state, 16)["batch_in_epoch"] == 1


def test_a_batch_size_change_is_refused_with_batches_sampled_ahead():
    """one_step_off: the queued batch's prompts are drawn again on resume for their dataset rows;
    at a new batch size they were other rows (wrong ground truth) or an IndexError."""
    change = resume.Change("data.train_batch_size", 8, 4)
    loader = {"epoch": 0, "batch_in_epoch": 3, "batch_size": 8, "seed": 1}
    with pytest.raises(resume.ResumeConfigError,
                       match=r"data.train_batch_size: 8 in the checkpoint -> 4 from the config: "
                             r"the checkpoint holds 1 batch\(es\) of 8 prompts sampled ahead.*"
                             r"Set data.train_batch_size=8 again"):
        resume.apply_to_state([change], {"loader": loader, "rollout_queue": [{"saved": 1}]},
                              PromptLoader.rebatch)
    state = resume.apply_to_state([change], {"loader": loader, "rollout_queue": []},  # sync
                                  PromptLoader.rebatch)
    assert state["loader"]["batch_size"] == 4


def test_a_batch_size_change_is_refused_with_partial_rollouts_in_flight(caplog):
    """rollout.partial: the groups in flight are found again by their place in the saved
    batches; turning partial rollouts off drops them, said in the log."""
    loader = {"epoch": 0, "batch_in_epoch": 3, "batch_size": 8, "seed": 1}
    saved = {"loader": loader, "rollout_queue": [], "rollout_partial": {"serials": [17]}}
    with pytest.raises(resume.ResumeConfigError,
                       match=r"holds partial rollouts in flight.*Set data.train_batch_size=8 again"):
        resume.apply_to_state([resume.Change("data.train_batch_size", 8, 4)], saved,
                              PromptLoader.rebatch)
    with caplog.at_level("WARNING", logger="verl_mcore.config.resume"):
        resume.apply_to_state([resume.Change("rollout.partial.enable", True, False)], saved,
                              PromptLoader.rebatch)
    assert "samples in flight are dropped" in caplog.text


def test_a_mode_change_is_refused_with_fully_async_samples_in_flight():
    """rollout.mode=fully_async's checkpoint holds its pools and the batch it handed over, which
    another producer would drop; a partial rollouts' checkpoint may still change mode."""
    loader = {"epoch": 0, "batch_in_epoch": 3, "batch_size": 8, "seed": 1}
    saved = {"loader": loader, "rollout_queue": [{"saved": 1}],
             "rollout_partial": {"mode": "fully_async", "serials": [17]}}
    with pytest.raises(resume.ResumeConfigError,
                       match=r"fully_async's samples in flight.*Set rollout.mode=fully_async"):
        resume.apply_to_state([resume.Change("rollout.mode", "fully_async", "sync")], saved,
                              PromptLoader.rebatch)
    partial = {"loader": loader, "rollout_queue": [], "rollout_partial": {"serials": [17]}}
    resume.apply_to_state([resume.Change("rollout.mode", "sync", "one_step_off")], partial,
                          PromptLoader.rebatch)


@pytest.mark.parametrize("change", [["actor.ppo_mini_batch_size=4"], ["actor.ppo_epochs=3"],
                                    ["data.train_batch_size=16"]])
def test_the_lr_continues_at_the_training_step_after_a_batch_change(change):
    """The schedule's length is total_steps x optimizer steps per training step; a resume kept
    the checkpoint's counter (in the old unit) against the new length, and the LR jumped."""
    import torch

    from verl_mcore.build import optimizer_steps_per_training_step
    from verl_mcore.config.schema import OptimConfig
    from verl_mcore.engine.engine import _build_scheduler

    optim = OptimConfig(lr=1e-3, min_lr=1e-5, lr_schedule="cosine", lr_warmup_steps=2)
    common = ["trainer.total_steps=10", "data.train_batch_size=8", "actor.ppo_mini_batch_size=2"]
    old, new = Config.load(None, common), Config.load(None, common + change)

    def scheduler(cfg, training_steps):
        per_step = optimizer_steps_per_training_step(cfg, "actor")
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
        s = _build_scheduler(optim, opt, cfg.trainer.total_steps * per_step)
        s.step(training_steps * per_step)
        return s, per_step

    saved, saved_per_step = scheduler(old, 6)
    resumed, per_step = scheduler(new, 0)
    assert per_step != saved_per_step
    resumed.num_steps = 0  # as load_checkpoint does
    resumed.load_state_dict(saved.state_dict())
    resume.rescale_schedule("actor", resumed, saved_per_step, per_step)
    straight, _ = scheduler(new, 6)
    assert resumed.num_steps == straight.num_steps
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]


# ---------------------------------------------------------------------------------------------
# The trainer (1 rank, the tiny model)

def _start(rank, world_size, overrides, run=True):
    import logging

    from megatron.core import parallel_state

    from verl_mcore.trainer import Trainer

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("verl_mcore.config.resume")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    parallel_state.destroy_model_parallel()
    try:
        trainer = Trainer(Config.load(str(ROOT / "configs/quickstart.yaml"), overrides))
    except resume.ResumeConfigError as e:
        return {"error": str(e)}
    finally:
        logger.removeHandler(handler)
    opt = trainer.actor.engine.optimizer
    out = {"log": lines, "step": trainer.step_index, "lr": opt.param_groups[0]["lr"],
           "betas": list(opt.param_groups[0]["betas"]), "sched_steps": trainer.actor.engine.scheduler.num_steps,
           "loader": [trainer.loader.batch_in_epoch, trainer.loader.batch_size]}
    out["code"] = trainer.fit() if run else trainer.finish()
    return out


def test_trainer_applies_the_new_lr_and_refuses_a_new_vocab_padding(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    run_dir = str(tmp_path / "run")
    base = _overrides(model, run_dir, "grpo", (1, 1, 1)) + ["trainer.val_every=0",
                                                            "checkpoint.save_every=1"]
    [first] = run_on_ranks(_start, 1, args=(base + ["trainer.total_steps=1"],))
    assert first["code"] == 0 and first["lr"] == 0.003

    changed = base + ["trainer.total_steps=2", "actor.optim.lr=0.0001", "actor.optim.adam_beta1=0.5",
                      "data.train_batch_size=2", "actor.ppo_mini_batch_size=1"]
    [second] = run_on_ranks(_start, 1, args=(changed,))
    assert second["code"] == 0 and second["step"] == 1
    assert "resume: actor.optim.lr: 0.003 in the checkpoint -> 0.0001 from the config" in second["log"]
    assert "resume: data.train_batch_size: 4 in the checkpoint -> 2 from the config" in second["log"]
    assert second["lr"] == 0.0001 and second["betas"] == [0.5, 0.999]
    assert second["sched_steps"] == 4  # the checkpoint's: step 1 took 2 epochs x 2 mini-batches
    assert second["loader"] == [2, 2]  # 4 prompts done: the third batch of 2 is next
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [(r["step"], r["actor/lr"]) for r in rows] == [(1, 0.003), (2, 0.0001)]

    [refused] = run_on_ranks(_start, 1, args=(changed + ["model.make_vocab_size_divisible_by=100"],))
    assert "model.make_vocab_size_divisible_by=100" in refused["error"]
    assert "the checkpoint's embedding has 128" in refused["error"]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert [json.loads(line) for line in f] == rows
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints", "actor"))) == [
        "latest", "step_00000001", "step_00000002"]
    # The refused start released the run directory: the same process may start again.
    [again] = run_on_ranks(_start, 1, args=(changed, False))
    assert again["step"] == 2 and not again["log"]
