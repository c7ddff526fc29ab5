"""Validation metrics (verl_mcore/val_metrics.py): each metric against hand-computed values and
the libraries called directly, the per-data-source reduction, the generations file, and the
start-up errors (unknown names, missing packages, a user function of the wrong signature)."""
import importlib.machinery
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl_mcore.config import Config, ConfigError, validate
from verl_mcore.config.validate import val_metric_errors
from verl_mcore.val_metrics import (ValMetrics, ValSamples, bleu, check_metric_fn, exact_match,
                                    reference_of, rouge, write_generations)


def test_exact_match_strips_and_counts():
    assert exact_match(["0000", " 11 ", "2"], ["0000", "11", "22"]) == pytest.approx(2 / 3)


def test_rouge_hand_computed_and_equal_to_rouge_score():
    from rouge_score import rouge_scorer

    responses, refs = ["the cat sat", "a dog"], ["the cat sat down", "a dog"]
    got = rouge(responses, refs)
    # sample 1: unigrams 3 of 3 predicted, 3 of 4 reference: F1 = 2*1*0.75/1.75 = 6/7;
    # bigrams 2 of 2, 2 of 3: F1 = 0.8; the LCS is 3 words: as rouge1. Sample 2 is exact: 1.
    assert got["rouge1"] == pytest.approx((6 / 7 + 1) / 2)
    assert got["rouge2"] == pytest.approx((0.8 + 1) / 2)
    assert got["rougeL"] == pytest.approx((6 / 7 + 1) / 2)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    direct = [scorer.score(r, p) for p, r in zip(responses, refs)]
    for k in ("rouge1", "rouge2", "rougeL"):
        assert got[k] == pytest.approx(sum(d[k].fmeasure for d in direct) / 2)


def test_rouge_kwargs_reach_the_scorer():
    # "cats" vs "cat": only the Porter stemmer makes them one token
    assert rouge(["cats"], ["cat"])["rouge1"] == 0.0
    assert rouge(["cats"], ["cat"], use_stemmer=True)["rouge1"] == 1.0


def test_bleu_equals_sacrebleu_corpus_bleu():
    import sacrebleu

    hyps = ["the cat sat on the mat", "hello there general kenobi"]
    refs = ["the cat sat on a mat", "hello there general kenobi"]
    assert bleu(hyps, refs) == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert bleu(["a b c d"], ["a b c d"]) == pytest.approx(100.0)
    assert 0 < bleu(hyps, refs) < 100
    # kwargs reach corpus_bleu: case matters unless lowercase=True
    assert bleu(["A B C D"], ["a b c d"]) < 100
    assert bleu(["A B C D"], ["a b c d"], lowercase=True) == pytest.approx(100.0)


def test_reference_of_rows():
    assert reference_of({"reward_model": {"ground_truth": "7"}}) == "7"
    assert reference_of({"reward_model": {"ground_truth": 42}}) == "42"
    for row in ({}, {"reward_model": None}, {"reward_model": {"ground_truth": None}},
                {"reward_model": {"ground_truth": ["a", "b"]}}, {"reward_model": {"ground_truth": True}}):
        assert reference_of(row) is None


def _row(source, truth):
    return {"data_source": source, "reward_model": {"ground_truth": truth} if truth is not None else None}


def _batch(rows, responses, groups):
    return SimpleNamespace(rows=rows, responses=responses, group_ids=torch.tensor(groups))


def _samples(keep_prompts=0):
    """Two validation batches, n = 2 samples per prompt, two data sources."""
    s = ValSamples(keep_prompts=keep_prompts)
    texts = lambda k: [f"p{i}" for i in range(k)]  # noqa: E731
    # batch 1: prompt 0 (src a, ref "x"), prompt 1 (src b, no reference)
    s.add(_batch([_row("a", "x")] * 2 + [_row("b", None)] * 2, ["x", "y", "x", "x"], [0, 0, 1, 1]),
          [1.0, 0.0, 0.5, 0.25], {"rule/exact": [1.0, 0.0, None, None]}, texts)
    # batch 2: prompt 0 (src a, ref "y"); a new extra, none of the old one
    s.add(_batch([_row("a", "y")] * 2, ["y", "y "], [0, 0]), [0.75, 0.5],
          {"rule/len": [1.0, 2.0]}, texts)
    return s


def _metrics(**kw):
    args = dict(names=["exact_match"], kwargs={}, pass_threshold=1.0, n=2, num_generations=0)
    args.update(kw)
    return ValMetrics(**args)


def test_samples_keep_extras_aligned_and_groups_apart():
    s = _samples()
    assert s.groups == [0, 0, 1, 1, 2, 2]  # the second batch's prompt 0 is a prompt of its own
    assert s.extras == {"rule/exact": [1.0, 0.0, None, None, None, None],
                        "rule/len": [None, None, None, None, 1.0, 2.0]}
    assert s.prompts == []


def test_metrics_per_data_source():
    out = _metrics().compute(_samples())
    # source a: samples 0, 1, 4, 5 (prompts 0 and 2), source b: samples 2, 3 (prompt 1)
    assert out["val/a/score/mean@2"] == pytest.approx((1.0 + 0.0 + 0.75 + 0.5) / 4)
    assert out["val/a/pass@2"] == 0.5  # prompt 0's best is 1.0, prompt 2's 0.75
    assert out["val/b/pass@2"] == 0.0
    assert out["val/a/exact_match"] == 0.75  # "x"=="x", "y"!="x", "y"=="y", "y "=="y"
    assert out["val/a/no_reference"] == 0.0 and out["val/b/no_reference"] == 2.0
    assert "val/b/exact_match" not in out  # no sample of b has a reference
    assert out["val/a/reward/rule/exact/mean"] == 0.5 and out["val/a/reward/rule/len/mean"] == 1.5
    assert "val/b/reward/rule/exact/mean" not in out  # b's samples have no value


def test_pass_threshold():
    out = _metrics(pass_threshold=0.5).compute(_samples())
    assert out["val/a/pass@2"] == 1.0 and out["val/b/pass@2"] == 1.0
    assert _metrics(pass_threshold=0.8).compute(_samples())["val/a/pass@2"] == 0.5


def test_user_function_per_source():
    calls = []

    def fn(responses, references, rows):
        calls.append((responses, references, [r["data_source"] for r in rows]))
        return {"custom/len": sum(map(len, responses)) / len(responses)}

    out = _metrics(names=[], fn=fn).compute(_samples())
    assert calls == [(["x", "y", "y", "y "], ["x", "x", "y", "y"], ["a"] * 4),
                     (["x", "x"], [None, None], ["b"] * 2)]
    assert out["val/a/custom/len"] == 1.25 and out["val/b/custom/len"] == 1.0
    assert "val/a/no_reference" not in out  # only with text metrics


@pytest.mark.parametrize("result, message", [
    ([1.0], "returned list, not a dict"), ({"m": "high"}, "'m': 'high', not a finite number"),
    ({"m": float("nan")}, "not a finite number"), ({3: 1.0}, "returned the key 3"),
])
def test_user_function_bad_results(result, message):
    with pytest.raises(ValueError, match="trainer.val_metric_fn") as e:
        _metrics(fn=lambda *a: result).compute(_samples())
    assert message in str(e.value)


def test_report_on_one_rank_returns_the_metrics_and_writes_generations(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    out = _metrics(num_generations=3).report(_samples(keep_prompts=3), 4, str(tmp_path))
    assert out["val/a/exact_match"] == 0.75
    lines = (tmp_path / "val_generations" / "step_4.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"prompt": "p0", "response": "x", "score": 1.0, "reference": "x", "data_source": "a"},
        {"prompt": "p1", "response": "y", "score": 0.0, "reference": "x", "data_source": "a"},
        {"prompt": "p2", "response": "x", "score": 0.5, "reference": None, "data_source": "b"}]

    with pytest.raises(Exception, match="validation at step 4: ValueError: trainer.val_metric_fn"):
        _metrics(fn=lambda *a: None).report(_samples(), 4, str(tmp_path))


def _report_on_ranks(rank, world_size, run_dir, fail):
    from verl_mcore.val_metrics import ValMetricError

    def fn(responses, references, rows):
        if fail:
            raise RuntimeError("metric broke")
        return {"custom/len": sum(map(len, responses)) / len(responses)}

    # only rank 0 holds the samples (Trainer.validate) and the user's function
    metrics = _metrics(num_generations=2, fn=fn if rank == 0 else None)
    try:
        return metrics.report(_samples(keep_prompts=2) if rank == 0 else None, 3, run_dir)
    except ValMetricError as e:
        return f"ValMetricError: {e}"


def test_report_gives_every_rank_rank_0s_metrics_or_its_error(tmp_path):
    from tests.multiproc import run_on_ranks

    results = run_on_ranks(_report_on_ranks, 2, args=(str(tmp_path), False), timeout=120)
    assert results[0] == results[1] and results[0]["val/a/custom/len"] == 1.25
    assert len((tmp_path / "val_generations" / "step_3.jsonl").read_text().splitlines()) == 2
    results = run_on_ranks(_report_on_ranks, 2, args=(str(tmp_path), True), timeout=120)
    assert results == ["ValMetricError: validation at step 3: RuntimeError: metric broke"] * 2


def test_generations_file_is_replaced_whole(tmp_path):
    s = _samples(keep_prompts=6)
    write_generations(s, 2, str(tmp_path), 6)
    path = write_generations(s, 2, str(tmp_path), 1)
    assert len(open(path).read().splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "val_generations").iterdir()) == ["step_2.jsonl"]


# ---- start-up errors --------------------------------------------------------------------------

def _cfg(*overrides):
    return Config.load(None, list(overrides))


QUICKSTART = str(Path(__file__).resolve().parents[1] / "configs/quickstart.yaml")


@pytest.mark.parametrize("off", [["trainer.val_every=0"], ["trainer.val_every=0", "data.val_files=[]"]],
                         ids=["val_every=0", "no val files"])
@pytest.mark.parametrize("keys, named, removed", [
    (["trainer.val_metrics=[exact_match, bleu]"], "trainer.val_metrics=['exact_match', 'bleu']",
     "trainer.val_metrics=[]"),
    (["trainer.val_metrics=[rouge]", "trainer.val_metric_kwargs={rouge: {use_stemmer: true}}"],
     "trainer.val_metrics=['rouge'], trainer.val_metric_kwargs={'rouge': {'use_stemmer': True}}",
     "trainer.val_metrics=[] trainer.val_metric_kwargs={}"),
    (["trainer.val_metric_fn.path=m.py", "trainer.val_metric_fn.name=f"],
     "trainer.val_metric_fn.path=m.py, trainer.val_metric_fn.name=f",
     "trainer.val_metric_fn.path=null trainer.val_metric_fn.name=null"),
    (["trainer.log_val_generations=5"], "trainer.log_val_generations=5",
     "trainer.log_val_generations=0"),
], ids=["val_metrics", "val_metric_kwargs", "val_metric_fn", "log_val_generations"])
def test_validation_settings_while_validation_is_off_are_refused(off, keys, named, removed):
    with pytest.raises(ConfigError) as e:
        validate(Config.load(QUICKSTART, [*off, *keys]), 1)
    msg = str(e.value)
    assert f"{named} configure validation, which is off (trainer.val_every=0 and " \
           "trainer.val_before_train=false" in msg, msg
    assert ("and data.val_files is empty)" in msg) == ("data.val_files=[]" in off)
    assert msg.endswith(f"or remove them: {removed}"), msg


def test_validation_settings_pass_when_validation_runs_and_defaults_never_trip():
    metrics = ["trainer.val_metrics=[exact_match]", "trainer.log_val_generations=5"]
    validate(Config.load(QUICKSTART, metrics), 1)  # the quickstart validates every 25 steps
    validate(Config.load(QUICKSTART, [*metrics, "trainer.val_every=0",
                                      "trainer.val_before_train=true"]), 1)
    validate(Config.load(QUICKSTART, ["trainer.val_every=0", "data.val_files=[]"]), 1)
    # asked for without files: the one error says to give files or turn it off, not both
    with pytest.raises(ConfigError) as e:
        validate(Config.load(QUICKSTART, [*metrics, "data.val_files=[]"]), 1)
    assert "trainer.val_every=25 but data.val_files is empty" in str(e.value)
    assert "configure validation" not in str(e.value)


def test_unknown_metric_without_evaluate_names_the_key_and_the_options():
    if "evaluate" in sys.modules or __import__("importlib").util.find_spec("evaluate"):
        pytest.skip("evaluate is installed here")
    with pytest.raises(ConfigError) as e:
        validate(_cfg("trainer.val_metrics=[rouge, bertscore]"), 1)
    msg = str(e.value)
    assert "trainer.val_metrics[1]='bertscore' is not a built-in metric (exact_match, rouge, bleu)" in msg
    assert "pip install evaluate" in msg and "val_metrics[0]" not in msg


def test_missing_package_names_the_pip_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("rouge_score", "sacrebleu") else real(name, *a))
    errs = val_metric_errors(_cfg("trainer.val_metrics=[exact_match, rouge, bleu]").trainer)
    assert errs == [
        "trainer.val_metrics[1]='rouge' needs the rouge-score package, which is not installed: "
        "pip install rouge-score",
        "trainer.val_metrics[2]='bleu' needs the sacrebleu package, which is not installed: "
        "pip install sacrebleu"]


def test_kwargs_and_duplicates_are_checked():
    errs = val_metric_errors(_cfg("trainer.val_metrics=[bleu, bleu, exact_match]",
                              "trainer.val_metric_kwargs={rouge: {use_stemmer: true}, "
                              "exact_match: {a: 1}}").trainer)
    assert any("names a metric twice" in e for e in errs)
    assert any(e.startswith("trainer.val_metric_kwargs.rouge: 'rouge' is not in") for e in errs)
    assert any("exact_match takes no arguments" in e for e in errs)


@pytest.fixture
def fake_evaluate(monkeypatch):
    """A stand-in for the HF `evaluate` library (not installed here): load(name) knows one metric."""
    module = types.ModuleType("evaluate")
    module.__spec__ = importlib.machinery.ModuleSpec("evaluate", None)

    class BertScore:
        def compute(self, predictions, references, lang="en"):
            assert lang == "de"  # val_metric_kwargs reach compute
            return {"f1": [float(p == r) for p, r in zip(predictions, references)],
                    "precision": 0.25, "hashcode": "roberta-large_L17"}

    def load(name):
        if name != "bertscore":
            raise FileNotFoundError(f"Couldn't find a module script at {name}.py")
        return BertScore()

    module.load = load
    monkeypatch.setitem(sys.modules, "evaluate", module)
    return module


def test_evaluate_metric_by_name(fake_evaluate):
    cfg = _cfg("trainer.val_metrics=[bertscore]", "trainer.val_metric_kwargs={bertscore: {lang: de}}")
    assert val_metric_errors(cfg.trainer) == []  # a name evaluate may know passes the config check
    out = ValMetrics.from_config(cfg, 0).compute(_samples())
    # source a: "x"=="x", "y"!="x", "y"=="y", "y "!="y" (not stripped for an evaluate metric)
    assert out["val/a/bertscore/f1"] == 0.5 and out["val/a/bertscore/precision"] == 0.25
    assert "val/a/bertscore/hashcode" not in out


def test_evaluate_cannot_load_the_name(fake_evaluate):
    with pytest.raises(ConfigError) as e:
        ValMetrics.from_config(_cfg("trainer.val_metrics=[exact_match, bleurt_typo]"), 0)
    msg = str(e.value)
    assert msg.startswith("trainer.val_metrics[1]='bleurt_typo' is not a built-in metric "
                          "(exact_match, rouge, bleu) and evaluate.load('bleurt_typo') failed: "
                          "FileNotFoundError")
    assert "cached here: none" in msg


def test_check_metric_fn_signature():
    assert check_metric_fn(lambda responses, references, rows: {}, "k") == "function"
    assert check_metric_fn(lambda *args: {}, "k") == "function"
    with pytest.raises(ValueError, match=r"k.name: .*\(responses, references\) cannot be called as "
                                         r"fn\(responses, references, rows\)"):
        check_metric_fn(lambda responses, references: {}, "k")
    with pytest.raises(ValueError, match="is not a function"):
        check_metric_fn(3, "k")


def test_metric_fn_from_a_file(tmp_path):
    (tmp_path / "m.py").write_text("def good(responses, references, rows):\n    return {'n': len(rows)}\n"
                                   "def bad(responses):\n    return {}\n")
    key = [f"trainer.val_metric_fn.path={tmp_path / 'm.py'}"]
    metrics = ValMetrics.from_config(_cfg(*key, "trainer.val_metric_fn.name=good"), 0)
    assert metrics.compute(_samples())["val/b/n"] == 2.0
    assert ValMetrics.from_config(_cfg(*key, "trainer.val_metric_fn.name=good"), 1).fn is None
    with pytest.raises(ConfigError, match=r"trainer.val_metric_fn.name: bad\(responses\) cannot be called"):
        ValMetrics.from_config(_cfg(*key, "trainer.val_metric_fn.name=bad"), 0)
    with pytest.raises(ValueError, match="trainer.val_metric_fn.name='nope': .* defines no such name"):
        ValMetrics.from_config(_cfg(*key, "trainer.val_metric_fn.name=nope"), 0)


def test_metric_fn_that_blocks_at_import_fails_within_its_time_limit(tmp_path):
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(60)\ndef f(a, b, c):\n    return {}\n")
    with pytest.raises(ConfigError,
                       match=r"did not finish within trainer.val_metric_fn.import_timeout_s=1.0"):
        ValMetrics.from_config(_cfg(f"trainer.val_metric_fn.path={tmp_path / 'slow.py'}",
                                    "trainer.val_metric_fn.name=f",
                                    "trainer.val_metric_fn.import_timeout_s=1"), 0)


def test_user_function_may_not_take_a_builtin_name_nor_block():
    import time

    with pytest.raises(ValueError, match=r"returned \['score/mean@2'\]: the built-in metrics"):
        _metrics(fn=lambda *a: {"score/mean@2": 123.0}).compute(_samples())
    t0 = time.monotonic()
    # 1 s: the worker thread must have reached the user's line for its stack to name it
    with pytest.raises(TimeoutError, match=r"trainer.val_metric_fn.timeout_s=1.0 s; it was here "
                                           r"\(most recent call last\):\n  File .*test_val_metrics.py"):
        _metrics(fn=lambda *a: time.sleep(60), fn_timeout_s=1.0).compute(_samples())
    assert time.monotonic() - t0 < 5


def test_rouge_kwargs_and_the_generations_directory_are_checked_at_start(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.val_metric_kwargs.rouge=\{'bogus': 1\}: TypeError"):
        ValMetrics.from_config(_cfg("trainer.val_metrics=[rouge]",
                                    "trainer.val_metric_kwargs={rouge: {bogus: 1}}"), 0)
    run = tmp_path / "run"
    run.mkdir()
    (run / "val_generations").write_text("a file where the directory goes")
    with pytest.raises(ConfigError, match=r"trainer.log_val_generations: cannot create"):
        ValMetrics.from_config(_cfg(f"trainer.run_dir={run}", "trainer.log_val_generations=3"), 0)
