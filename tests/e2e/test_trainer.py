"""The trainer end to end on the tiny quickstart model: 1 rank, and 4 ranks at TP=2 × PP=2 with
generation TP=2; GRPO and PPO (with a critic), a few steps each, every metric present and finite."""
import json
import math
import os
from pathlib import Path

import pytest

from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]

# Metric names RLHF users know (issue 8); the critic ones only exist with a critic.
COMMON = [
    "critic/score/mean", "critic/score/max", "critic/score/min", "critic/rewards/mean",
    "critic/advantages/mean", "critic/returns/mean", "actor/pg_loss", "actor/pg_clipfrac",
    "actor/ppo_kl", "actor/entropy", "actor/kl_loss", "actor/grad_norm", "actor/lr",
    "response_length/mean", "response_length/max", "response_length/clip_ratio",
    "prompt_length/mean", "timing_s/gen", "timing_s/actor", "timing_s/old_logp", "timing_s/ref",
    "perf/throughput", "perf/mfu/actor", "perf/max_memory_allocated_gb", "reward/rule/mean",
    "reward/errors", "rollout/logprob_diff_max", "perf/offloaded_gb",
]
WITH_CRITIC = ["critic/values/mean", "critic/vf_explained_var", "critic/vf_loss", "timing_s/critic"]
# The one-rank PPO run's critic update is one optimizer step: its own forward passes give the
# values (engine/critic.py), so no values pass runs; the four-rank run's takes two and has one.
CRITIC_ONE_STEP = ["critic.ppo_epochs=1", "critic.ppo_mini_batch_size=4"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def _overrides(model_dir, run_dir, algo, layout):
    tp, pp, tp_g = layout
    out = [f"model.path={model_dir}", f"trainer.run_dir={run_dir}", "trainer.total_steps=3",
           "trainer.val_every=2", "checkpoint.save_every=2",
           f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]",
           f"data.val_files=[{ROOT}/examples/data/quickstart_val.parquet]",
           f"reward.custom_fn.path={ROOT}/examples/quickstart_reward.py",
           "reward.num_workers=0", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
           "actor.micro_batch_size_per_gpu=2", "critic.micro_batch_size_per_gpu=2",
           "actor.use_kl_loss=true", "actor.ppo_epochs=2",
           f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
           f"rollout.tensor_parallel_size={tp_g}", "rollout.logprob_check.num_sequences=2",
           "trainer.offload_between_phases=true"]  # on CPU "auto" would not offload
    if algo == "grpo":
        out += ["algorithm.adv_estimator=grpo", "rollout.n=2"]
    else:
        out += ["algorithm.adv_estimator=gae", "rollout.n=1", "algorithm.gamma=1.0", "algorithm.lam=0.95"]
    return out


def _train(rank, world_size, overrides):
    from verl_mcore.config import Config, validate
    from verl_mcore.trainer import Trainer

    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)
    validate(cfg, world_size)
    code = Trainer(cfg).fit()
    return code


def _check_metrics(run_dir: Path, algo: str, steps: int, values_pass: bool = True) -> list[dict]:
    """Every step's metrics row: the named metrics present and finite, and the weight-sync check
    passed (the engine samples from the actor's weights)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    needed = COMMON + (WITH_CRITIC if algo == "ppo" else [])
    if algo == "ppo":
        assert all(("timing_s/values" in r) is values_pass for r in rows)
    for row in rows:
        missing = [k for k in needed if k not in row]
        assert not missing, f"step {row['step']}: missing {missing}"
        bad = [k for k in needed if row[k] is None or not math.isfinite(row[k])]
        assert not bad, f"step {row['step']}: non-finite {bad}"
        assert row["rollout/logprob_diff_max"] < 1e-3  # generation weights == actor weights
    return rows


def _check_run(run_dir: Path, algo: str, values_pass: bool = True):
    rows = _check_metrics(run_dir, algo, 3, values_pass)
    assert any(k.startswith("val/") and "score/mean@" in k for k in rows[1])
    ckpts = sorted(p.name for p in (run_dir / "checkpoints" / "actor").glob("step_*"))
    assert ckpts == ["step_00000002", "step_00000003"]
    if algo == "ppo":
        assert (run_dir / "checkpoints" / "critic" / "step_00000003").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_trainer_one_rank(tiny_model, tmp_path, algo):
    run_dir = tmp_path / "run"
    overrides = _overrides(tiny_model, run_dir, algo, (1, 1, 1)) + CRITIC_ONE_STEP
    assert run_on_ranks(_train, 1, args=(overrides,), timeout=600, fresh=True) == [0]
    _check_run(run_dir, algo, values_pass=False)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_trainer_four_ranks_tp2_pp2_gen_tp2(tiny_model, tmp_path, algo):
    run_dir = tmp_path / "run"
    codes = run_on_ranks(_train, 4, args=(_overrides(tiny_model, run_dir, algo, (2, 2, 2)),),
                         timeout=900, fresh=True)
    assert codes == [0, 0, 0, 0]
    _check_run(run_dir, algo)


# ---------------------------------------------------------------------------------------------
# Generation TP below training TP, with vocabularies whose padding Megatron's old "divisible × TP"
# rule gets wrong (issue 17): the generation model must pad exactly as the training model does.

@pytest.fixture(scope="module")
def tiny_model_4_kv_heads(tmp_path_factory):
    """The quickstart model with as many KV heads as query heads: TP = 4 needs 4 KV groups."""
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_mha") / "model"), kv_heads=4)


def _old_and_new_padding(model_dir: str, tp: int, tp_g: int, divisible_by: int) -> tuple[int, int]:
    """(generation padding under Megatron's divisible × TP_t / TP_g rule, the training padding)."""
    from verl_mcore.models.hf_config import padded_vocab_size, read_hf_arch

    vocab = read_hf_arch(model_dir).vocab_size
    return (padded_vocab_size(vocab, tp_g, divisible_by * tp // tp_g),
            padded_vocab_size(vocab, tp, divisible_by))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("algo, layout, divisible_by", [
    ("grpo", (2, 1, 1), 128),  # DP = 2; 36 ids pad to 128 (old rule: 256)
    ("ppo", (2, 2, 1), 100),   # DP = 1, PP = 2; 100 (old rule: 200)
    ("grpo", (4, 1, 2), 7),    # DP = 1; 56, the last TP_t shard all padding (old rule: 42)
    ("ppo", (4, 1, 2), 128),   # 128 (old rule: 256)
])
def test_trainer_generation_tp_below_training_tp(tiny_model, tiny_model_4_kv_heads, tmp_path, algo,
                                                 layout, divisible_by):
    tp, _, tp_g = layout
    model_dir = tiny_model_4_kv_heads if tp == 4 else tiny_model
    old, new = _old_and_new_padding(model_dir, tp, tp_g, divisible_by)
    assert old != new  # else this run would not tell the two rules apart
    run_dir = tmp_path / "run"
    overrides = _overrides(model_dir, run_dir, algo, layout) + [
        f"model.make_vocab_size_divisible_by={divisible_by}", "trainer.total_steps=2",
        "trainer.val_every=0", "checkpoint.save_every=0", "actor.ppo_epochs=1"]
    codes = run_on_ranks(_train, 4, args=(overrides,), timeout=600, fresh=True)
    assert codes == [0, 0, 0, 0]
    _check_metrics(run_dir, algo, 2)


# ---------------------------------------------------------------------------------------------
# Non-finite losses: stop with the phase and last good step, or skip the update and count it.

def _nan_reward_overrides(model_dir, run_dir, mode, tmp_path, algo="grpo"):
    # A scorer that fails for half the digits; _nan_for_failed_scores turns those into NaN.
    fn = tmp_path / "nan_reward.py"
    fn.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    if ground_truth in '01234':\n"
                  "        raise ValueError('no score')\n"
                  "    return 0.5\n")
    return _overrides(model_dir, run_dir, algo, (1, 1, 1)) + [
        f"reward.custom_fn.path={fn}", "reward.custom_fn.name=score",
        "reward.max_failed_fraction=1.0", f"trainer.on_nonfinite={mode}",
        "trainer.val_every=0", "checkpoint.save_every=0", "trainer.total_steps=2"]


def _nan_for_failed_scores():
    """NaN as the score of every sample whose scorer failed. The reward checks no longer let a
    NaN through (a NaN reward.fallback_score is refused, a NaN return value is a failed score),
    so the non-finite guards of the update are tested with NaN put in by hand (fresh ranks)."""
    from verl_mcore.reward.manager import RewardManager

    score = RewardManager.score

    def nan_score(self, *args, **kwargs):
        out = score(self, *args, **kwargs)
        out.scores = [float("nan") if f else s for s, f in zip(out.scores, out.failed)]
        return out

    RewardManager.score = nan_score


def _train_catch(rank, world_size, overrides):
    from verl_mcore.config import Config
    from verl_mcore.trainer import NonFiniteError, Trainer

    _nan_for_failed_scores()
    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)
    trainer = Trainer(cfg)
    try:
        return trainer.fit(), None
    except NonFiniteError as e:
        return None, str(e)
    finally:
        trainer.finish()


@pytest.mark.slow
@pytest.mark.parametrize("algo, phase", [("grpo", "actor update"), ("ppo", "critic update")])
def test_nonfinite_stop_names_phase_and_last_good_step(tiny_model, tmp_path, algo, phase):
    # PPO: the critic updates first and must not write NaN weights unnoticed.
    [(code, message)] = run_on_ranks(
        _train_catch, 1, args=(_nan_reward_overrides(tiny_model, tmp_path / "r", "stop", tmp_path, algo),),
        timeout=300, fresh=True)
    assert code is None and f"{phase} at step 1" in message and "last good step is 0" in message


def _stop_request_body(rank, world_size, model_dir, tmp_path):
    """A stop request at a step that is also a save step: one save, exit 75."""
    import os

    from verl_mcore.config import Config
    from verl_mcore.trainer import Trainer

    request = os.path.join(tmp_path, "stop_request")
    open(request, "w").close()
    os.environ["VERL_MCORE_STOP_REQUEST"] = request
    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), _overrides(model_dir, f"{tmp_path}/a", "grpo", (1, 1, 1)) + [
        "checkpoint.save_every=1", "trainer.val_every=0", "trainer.total_steps=3"])
    trainer = Trainer(cfg)
    saves, save = [], trainer.checkpoints.save
    trainer.checkpoints.save = lambda step, *a, **k: (saves.append(step), save(step, *a, **k))[1]
    return trainer.fit(), saves


def _late_nan_body(rank, world_size, model_dir, tmp_path):
    import os

    from verl_mcore.config import Config
    from verl_mcore.trainer import NonFiniteError, Trainer

    out = {}
    _nan_for_failed_scores()
    fn = os.path.join(tmp_path, "late_nan.py")
    with open(fn, "w") as f:  # 8 scores per step (4 prompts x 2): failing (-> NaN) from step 2 on
        f.write("CALLS = [0]\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
                "    CALLS[0] += 1\n    if CALLS[0] > 8:\n        raise ValueError('no score')\n"
                "    return 0.5 + 0.1 * (CALLS[0] % 2)\n")
    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), _overrides(model_dir, f"{tmp_path}/b", "grpo", (1, 1, 1)) + [
        f"reward.custom_fn.path={fn}", "reward.custom_fn.name=score",
        "reward.max_failed_fraction=1.0", "checkpoint.async_save=true",
        "checkpoint.save_every=1", "trainer.val_every=0", "trainer.total_steps=3"])
    trainer = Trainer(cfg)
    try:
        trainer.fit()
        out["nan_error"] = None
    except NonFiniteError as e:
        out["nan_error"] = str(e)
    finally:
        trainer.finish()
    return out


@pytest.mark.slow
def test_stop_paths_keep_exactly_the_good_checkpoints(tiny_model, tmp_path):
    from verl_mcore.distributed.preemption import EXIT_PREEMPTED

    [(code, saves)] = run_on_ranks(_stop_request_body, 1, args=(tiny_model, str(tmp_path)), timeout=300,
                                   fresh=True)
    assert code == EXIT_PREEMPTED and saves == [1]  # not saved twice
    # NaN rewards from step 2 with async saves: the stop commits step 1's pending save first.
    [r] = run_on_ranks(_late_nan_body, 1, args=(tiny_model, str(tmp_path)), timeout=300, fresh=True)
    assert "at step 2" in r["nan_error"] and "last good step is 1" in r["nan_error"]
    ckpts = tmp_path / "b" / "checkpoints" / "actor"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000001"]
    assert (ckpts / "latest").exists() and not list(ckpts.glob(".tmp*"))


@pytest.mark.slow
def test_nonfinite_skip_counts_and_keeps_weights_finite(tiny_model, tmp_path):
    run_dir = tmp_path / "r"
    # (Most updates here see a NaN: no limit on skips in a row, to see them counted.)
    overrides = _nan_reward_overrides(tiny_model, run_dir, "skip", tmp_path) + [
        "trainer.max_consecutive_skips=1000"]
    [(code, message)] = run_on_ranks(_train_catch, 1, args=(overrides,), timeout=300, fresh=True)
    assert code == 0 and message is None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train/skipped_updates"] > 0
    # the weights stayed finite: the second step's log-probs and entropy are finite
    assert math.isfinite(rows[-1]["actor/old_entropy"])


def _refused_by_trainer_check(rank, world_size, model_dir, tmp_path):
    """train.main when a check inside the Trainer (the memory plan) raises ConfigError."""
    import contextlib
    import io

    from verl_mcore import build, train
    from verl_mcore.config import ConfigError

    def refuse(*args, **kwargs):
        raise ConfigError("the memory planner finds that ... would not fit")

    real, build.resolve_offload = build.resolve_offload, refuse
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = train.main(["--config", str(ROOT / "configs/quickstart.yaml")]
                              + _overrides(model_dir, f"{tmp_path}/r", "grpo", (1, 1, 1)))
    finally:
        build.resolve_offload = real
    return code, err.getvalue()


def test_a_config_error_from_the_trainer_exits_2_with_one_message(tiny_model, tmp_path):
    [(code, err)] = run_on_ranks(_refused_by_trainer_check, 1, args=(tiny_model, str(tmp_path)),
                                 timeout=120, fresh=True)
    assert code == 2 and "error before training: the memory planner finds" in err
    assert "Traceback" not in err

def _diverging_bodies(rank, world_size, model_dir, tmp_path):
    """Two runs of 2 steps: lr=1e30 (finite loss and grad norm, weights blown up by the step),
    and on_nonfinite=skip where every gradient norm is NaN."""
    from verl_mcore.engine import optim_step

    base = _overrides(model_dir, f"{tmp_path}/a", "grpo", (1, 1, 1)) + [
        "checkpoint.save_every=1", "trainer.val_every=0", "trainer.total_steps=2"]
    from megatron.core import parallel_state

    out = {"lr": _train_catch(rank, world_size, base + ["actor.optim.lr=1e30"])}
    parallel_state.destroy_model_parallel()  # a second trainer in this process
    real = optim_step.global_grad_norm
    optim_step.global_grad_norm = lambda optimizer: real(optimizer) * float("nan")
    try:
        out["skip"] = _train_catch(rank, world_size, [o.replace(f"{tmp_path}/a", f"{tmp_path}/b") for o in base]
                                   + ["trainer.on_nonfinite=skip", "trainer.max_consecutive_skips=3"])
    finally:
        optim_step.global_grad_norm = real
    return out


@pytest.mark.slow
def test_a_diverged_step_or_endless_skips_stop_the_run_and_save_nothing(tiny_model, tmp_path):
    """A step that blows up the weights stops in its own update (it was saved as the last good
    step, and the next step blamed the weight sync); skipping every update stops after
    trainer.max_consecutive_skips in a row (it exited 0 having trained nothing)."""
    [r] = run_on_ranks(_diverging_bodies, 1, args=(tiny_model, str(tmp_path)), timeout=300, fresh=True)
    code, message = r["lr"]
    assert code is None and "actor update at step 1" in message, message
    assert "made the weights non-finite" in message or "changed the norm of the weights" in message
    assert "last good step is 0" in message and "Lower the learning rate" in message
    assert not list((tmp_path / "a" / "checkpoints" / "actor").glob("step_*"))  # nothing saved
    code, message = r["skip"]
    # 4 samples / mini-batch 2 x 2 epochs = 4 optimizer steps a training step, all skipped: the
    # limit of 3 in a row is checked after the update, which stops the run in its first step.
    assert code is None and "last 4 optimizer steps of the actor were skipped" in message, message
    assert "max_consecutive_skips=3" in message
    assert "at step 1" in message
    assert not list((tmp_path / "b" / "checkpoints" / "actor").glob("step_*"))


# ---------------------------------------------------------------------------------------------
# Validation metrics (issue 20): text metrics, a user metric, scorer extras, the generations file.

VAL_METRIC_FN = '''
def response_chars(responses, references, rows):
    assert len(responses) == len(references) == len(rows)
    return {"custom/chars": sum(len(r) for r in responses) / len(responses),
            "custom/rows": float(len(rows))}
'''


def _val_overrides(tiny_model, run_dir, fn_path, fn_name="response_chars"):
    return _overrides(tiny_model, run_dir, "grpo", (1, 1, 1)) + CRITIC_ONE_STEP + [
        "trainer.val_metrics=[exact_match, rouge, bleu]", "trainer.val_pass_threshold=0.5",
        f"trainer.val_metric_fn.path={fn_path}", f"trainer.val_metric_fn.name={fn_name}",
        "trainer.log_val_generations=10", "checkpoint.save_every=0", "actor.ppo_epochs=1"]


@pytest.mark.slow
def test_validation_metrics_and_generations_file(tiny_model, tmp_path):
    import sacrebleu
    from rouge_score import rouge_scorer

    (tmp_path / "metric.py").write_text(VAL_METRIC_FN)
    run_dir = tmp_path / "run"
    overrides = _val_overrides(tiny_model, run_dir, tmp_path / "metric.py")
    assert run_on_ranks(_train, 1, args=(overrides,), timeout=600, fresh=True) == [0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = {k[len("val/quickstart/repeat_digit/"):]: v for k, v in rows[1].items()
           if k.startswith("val/quickstart/repeat_digit/")}
    assert not any(k.startswith("val/") for k in rows[0]) and not any(k.startswith("val/") for k in rows[2])
    # The whole validation set (10 prompts, val_n=1), every response with its reference: the
    # logged metrics recomputed from the file equal them.
    gens_file = run_dir / "val_generations" / "step_2.jsonl"
    gens = [json.loads(line) for line in gens_file.read_text().splitlines()]
    assert len(gens) == 10 and sorted(os.listdir(run_dir / "val_generations")) == ["step_2.jsonl"]
    assert [g["reference"] for g in gens] == [str(d) for d in range(10)]
    assert all(g["data_source"] == "quickstart/repeat_digit" and "repeat the digit" in g["prompt"]
               for g in gens)
    responses, refs = [g["response"] for g in gens], [g["reference"] for g in gens]
    scores = [g["score"] for g in gens]
    assert val["score/mean@1"] == pytest.approx(sum(scores) / 10)
    assert val["pass@1"] == pytest.approx(sum(s >= 0.5 for s in scores) / 10)
    assert val["exact_match"] == pytest.approx(sum(r.strip() == t for r, t in zip(responses, refs)) / 10)
    assert val["bleu"] == pytest.approx(sacrebleu.corpus_bleu(responses, [refs]).score)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    for k in ("rouge1", "rouge2", "rougeL"):
        direct = [scorer.score(t, r)[k].fmeasure for r, t in zip(responses, refs)]
        assert val[k] == pytest.approx(sum(direct) / 10)
    assert val["no_reference"] == 0.0
    assert val["custom/chars"] == pytest.approx(sum(map(len, responses)) / 10)
    assert val["custom/rows"] == 10.0
    # the quickstart scorer's extra key ("exact": the response is the digit four times)
    assert val["reward/rule/exact/mean"] == pytest.approx(
        sum(r.strip() == t * 4 for r, t in zip(responses, refs)) / 10)


def _start_with_bad_metric_fn(rank, world_size, overrides):
    from verl_mcore import build
    from verl_mcore.config import Config
    from verl_mcore.trainer import Trainer

    def no_models(*a, **k):
        raise AssertionError("a model was built before the metric function was checked")

    build.build_actor = no_models
    try:
        Trainer(Config.load(str(ROOT / "configs/quickstart.yaml"), overrides))
    except Exception as e:  # noqa: BLE001 - the message is the test
        return f"{type(e).__name__}: {e}"
    return "started"


def test_validation_metric_fn_of_the_wrong_signature_fails_before_any_model(tiny_model, tmp_path):
    (tmp_path / "metric.py").write_text("def two(responses, references):\n    return {}\n")
    overrides = _val_overrides(tiny_model, tmp_path / "run", tmp_path / "metric.py", "two")
    [msg] = run_on_ranks(_start_with_bad_metric_fn, 1, args=(overrides,), timeout=300, fresh=True)
    assert "trainer.val_metric_fn.name: two(responses, references) cannot be called as " \
           "fn(responses, references, rows)" in msg, msg
