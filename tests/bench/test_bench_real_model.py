"""bench/bench_real_model.py's bookkeeping: the training clocks of both sides, the curves read
from our metrics.jsonl, and when ours reaches TRL's final accuracy."""
import pytest

from bench import bench_real_model as bench

KEY = bench.VAL_KEY


def test_our_curve_sums_step_times_up_to_each_validation():
    rows = [{"step": 0, KEY: 0.25},
            {"step": 1, "timing_s/step": 2.0},
            {"step": 2, "timing_s/step": 1.5, KEY: 0.5},
            {"step": 3, "timing_s/step": 1.0},
            {"step": 4, "timing_s/step": 0.5, KEY: 0.75}]
    assert bench.our_curve(list(reversed(rows))) == [
        {"step": 0, "train_seconds": 0.0, "accuracy": 0.25},
        {"step": 2, "train_seconds": 3.5, "accuracy": 0.5},
        {"step": 4, "train_seconds": 5.0, "accuracy": 0.75}]


@pytest.mark.parametrize("rows", [
    [{"step": 0, KEY: 0.1}, {"step": 2, "timing_s/step": 1.0, KEY: 0.2}],  # step 1 missing
    [{"step": 1, KEY: 0.2}],                                               # no timing
])
def test_our_curve_refuses_a_clock_with_holes(rows):
    with pytest.raises(ValueError, match="timing_s/step"):
        bench.our_curve(rows)


def test_train_clock_leaves_evaluation_out():
    ticks = iter([10.0, 12.0, 20.0, 23.5])  # step 1 takes 2 s, 8 s of evaluation, step 2 takes 3.5
    clock = bench.TrainClock(now=lambda: next(ticks))
    assert clock.eval_point(0, 0.1, eval_seconds=4.0)["train_seconds"] == 0.0
    clock.step_begin()
    clock.step_end()
    clock.step_begin()
    clock.step_end()
    assert clock.eval_point(2, 0.6, eval_seconds=8.0) == {
        "step": 2, "train_seconds": 5.5, "accuracy": 0.6, "eval_seconds": 8.0}
    assert clock.step_seconds == [2.0, 3.5]
    with pytest.raises(RuntimeError, match="no step began"):
        clock.step_end()


def test_time_to_reach_and_summary():
    ours = [{"step": 0, "train_seconds": 0.0, "accuracy": 0.2},
            {"step": 5, "train_seconds": 4.0, "accuracy": 0.55},
            {"step": 10, "train_seconds": 8.0, "accuracy": 0.5},
            {"step": 15, "train_seconds": 12.0, "accuracy": 0.7}]
    trl = [{"step": 0, "train_seconds": 0.0, "accuracy": 0.2},
           {"step": 15, "train_seconds": 40.0, "accuracy": 0.55}]
    ppo = [{"step": 0, "train_seconds": 0.0, "accuracy": 0.2},
           {"step": 15, "train_seconds": 20.0, "accuracy": 0.4}]
    assert bench.time_to_reach(ours, 0.55)["step"] == 5
    assert bench.time_to_reach(ours, 0.9) is None
    s = bench.summarize({"grpo": ours, "ppo": ppo, "trl": trl})
    assert s["trl_final_accuracy"] == 0.55 and s["trl_train_seconds"] == 40.0
    assert s["grpo_reaches_trl_final"] == {"train_seconds": 4.0, "step": 5, "accuracy": 0.55}
    assert s["ppo_reaches_trl_final"] is None
    assert s["runs"]["grpo"] == {"start_accuracy": 0.2, "final_accuracy": 0.7, "best_accuracy": 0.7,
                                 "train_seconds": 12.0, "steps": 15}


def test_step0_agreement_matches_by_question():
    ours = [{"prompt": "user\nWhat is 1 + 2? Answer with only the number.\nassistant\n", "response": "3"},
            {"prompt": "user\nWhat is 2 + 2? Answer with only the number.\nassistant\n", "response": "5"}]
    trl = [{"question": "What is 1 + 2? Answer with only the number.", "response": "3 "},
           {"question": "What is 2 + 2? Answer with only the number.", "response": "4"}]
    assert bench.step0_agreement(ours, trl) == {"matched": 2, "identical": 1, "of": 2}


def test_flags_are_checked():
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "m", "--runs", "grpo,dpo"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "m", "--prompts", "3", "--n", "8", "--trl-micro-batch", "16"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "m", "--steps", "12", "--val-every", "5"])


def test_main_writes_json_and_png_after_each_run_and_reports_a_failed_one(tmp_path, monkeypatch):
    import json

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    curve = [{"step": 0, "train_seconds": 0.0, "accuracy": 0.25},
             {"step": 5, "train_seconds": 3.0, "accuracy": 0.75}]
    gens = [{"prompt": "What is 1 + 2? Answer with only the number.", "response": "3"}]
    ran = []

    def fake_ours(args, run, paths):
        ran.append((run, sorted(paths)))
        if run == "ppo":
            raise RuntimeError("ppo ... exited 1; the end of ppo.log: boom")
        return {"curve": curve, "step_seconds": [0.6] * 5, "wall_seconds": 9.0,
                "val_generations_step0": gens}

    def fake_trl(args, paths):
        ran.append(("trl", sorted(paths)))
        return {"curve": [dict(curve[0]), {"step": 5, "train_seconds": 10.0, "accuracy": 0.5}],
                "step_seconds": [2.0] * 5, "wall_seconds": 20.0,
                "val_generations_step0": [{"question": "What is 1 + 2? Answer with only the number.",
                                           "response": "3"}]}

    monkeypatch.setattr(bench, "run_ours", fake_ours)
    monkeypatch.setattr(bench, "run_trl", fake_trl)
    code = bench.main(["--model", str(model), "--workdir", str(tmp_path / "work"), "--device", "cpu",
                       "--steps", "5", "--val-every", "5", "--val-rows", "8"])
    assert code == 1 and ran == [(r, ["train", "val"]) for r in ("grpo", "ppo", "trl")]
    report = json.loads((tmp_path / "work" / "real_model_curves.json").read_text())
    assert (tmp_path / "work" / "real_model_curve.png").stat().st_size > 0
    assert set(report["runs"]) == {"grpo", "trl"} and "boom" in report["failures"]["ppo"]
    assert report["summary"]["grpo_reaches_trl_final"] == {"train_seconds": 3.0, "step": 5, "accuracy": 0.75}
    assert report["summary"]["step0_greedy_agreement"] == {"grpo": {"matched": 1, "identical": 1, "of": 1}}
