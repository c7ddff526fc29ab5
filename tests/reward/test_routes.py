"""Routing metrics: reward/route/<value>/mean and /count over the whole batch, exact however the
batch was split over ranks (Scorer.score gathers the per-sample route values and totals)."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.multiproc import run_on_ranks
from tests.reward import user_classes, user_fns
from tests.reward.test_manager import row
from verl_mcore.config.schema import CustomClassConfig, RewardConfig, RewardSourceConfig
from verl_mcore.reward import RewardManager
from verl_mcore.reward.manager import NO_ROUTE, route_metric_name, route_metrics
from verl_mcore.rollout.batch import Rollout

CATEGORIES = ["math", "chat", "math", None, "C++", "math", "chat"]
RESPONSES = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g"]
PROMPT_LENS = [1, 2, 3, 1, 2, 3, 4]


def _config(fns_path, classes_path, workers=0) -> RewardConfig:
    # the rule source scores every sample with the custom function (no routes: route_by only
    # names the column of the metrics); a batch class adds half the prompt's length
    return RewardConfig(num_workers=workers, route_by="category",
                        custom_fn=CustomClassConfig(path=fns_path, name="length_reward"),
                        sources=[RewardSourceConfig(name="rule"),
                                 RewardSourceConfig(name="prompt_len", type="custom", weight=0.5,
                                                    path=classes_path, function="Lengths",
                                                    kwargs={"name": "prompts"})])


def _rows():
    return [row(c) if c is not None else row() for c in CATEGORIES]


def test_metric_names_of_route_values():
    assert route_metric_name("math") == "math" and route_metric_name("a.b-c_1") == "a.b-c_1"
    assert route_metric_name(None) == NO_ROUTE == "<none>"
    # the example of the docs; two values that sanitise alike keep apart
    assert route_metric_name("C++") == "C__-fc2b4216"
    assert route_metric_name("C  ").startswith("C__-") and route_metric_name("C  ") != "C__-fc2b4216"
    assert route_metric_name("").startswith("-") and "/" not in route_metric_name("a/b")
    assert len(route_metric_name("x" * 500)) == 48 + 9


def test_route_metrics_from_uneven_slices_equal_the_whole_batch(tmp_path):
    fns, classes = user_fns.write(tmp_path), user_classes.write(tmp_path)
    prompts = ["p" * k for k in PROMPT_LENS]
    with RewardManager.from_config(_config(fns, classes)) as m:
        whole = m.score(RESPONSES, _rows(), prompts=prompts)
        # ranks of uneven slices, gathered per sample as Scorer.score does
        parts = [m.score(RESPONSES[a:b], _rows()[a:b], prompts=prompts[a:b]) for a, b in
                 ((0, 5), (5, 7))]
    assert whole.routes == ["math", "chat", "math", None, "C++", "math", "chat"]
    gathered = m.route_metrics([r for p in parts for r in p.routes],
                               [s for p in parts for s in p.scores])
    expected = route_metrics(whole.routes, whole.scores)
    assert gathered == expected
    # math: samples 0, 2, 5 with totals 1 + 0.5, 3 + 1.5, 6 + 1.5 (not the mean of the slices'
    # means, (1.5 + 4.5) / 2 and 7.5)
    assert expected["reward/route/math/mean"] == pytest.approx(13.5 / 3)
    assert expected["reward/route/math/count"] == 3.0
    assert expected["reward/route/<none>/count"] == 1.0
    assert expected[f"reward/route/{route_metric_name('C++')}/mean"] == 6.0
    assert sum(v for k, v in expected.items() if k.endswith("/count")) == 7
    with RewardManager.from_config(RewardConfig(num_workers=0)) as m:
        out = m.score(["#### 72"], [row("math")])
        assert out.routes == [] and m.route_metrics([None], out.scores) == {}


class _CharTokenizer:
    def batch_decode(self, ids, skip_special_tokens):
        return ["".join(chr(ord("a") + t) for t in seq) for seq in ids]


def _trainer_score_body(rank, world_size, fns, classes):
    from verl_mcore.scoring import Scorer

    # Each sample its own prompt of tokens 0..k-1; the responses are the texts given.
    rollout = dataclasses.replace(Rollout.from_samples(
        [(list(range(k)), row, [], "stop") for k, row in zip(PROMPT_LENS, _rows())], 32),
        responses=RESPONSES)
    with RewardManager.from_config(_config(fns, classes)) as manager:
        # every rank scores (no rollout set of its own)
        place = SimpleNamespace(training_ranks=tuple(range(world_size)), training=None)
        scorer = Scorer(None, manager, {}, [], place, _CharTokenizer(), torch.device("cpu"), rank)
        scores, metrics, extras = scorer.score(rollout)
    return scores.tolist(), metrics, extras


def test_trainer_route_metrics_on_two_ranks_equal_one_unsharded_batch(tmp_path):
    fns, classes = user_fns.write(tmp_path), user_classes.write(tmp_path)
    results = run_on_ranks(_trainer_score_body, 2, args=(fns, classes), timeout=180)
    prompts = [_CharTokenizer().batch_decode([list(range(k))], True)[0] for k in PROMPT_LENS]
    with RewardManager.from_config(_config(fns, classes)) as m:
        whole = m.score(RESPONSES, _rows(), prompts=prompts)
    expected = route_metrics(whole.routes, whole.scores)
    for scores, metrics, extras in results:  # rank 0 has 4 samples of the 7, rank 1 has 3
        assert scores == whole.scores
        # the scorers' extras of every sample, in batch order (validation reduces them per source)
        assert extras == whole.extras and extras["rule/chars"] == [float(len(r)) for r in RESPONSES]
        assert {k: v for k, v in metrics.items() if k.startswith("reward/route/")} == expected
        assert metrics["reward/prompt_len/mean"] == pytest.approx(sum(PROMPT_LENS) / 7)


PROMPT_READER = '''
class DigitInPrompt:
    """Batch: 1 when the prompt the model saw names the ground truth's digit, checked per sample."""

    def __init__(self, phrase):
        self.phrase = phrase

    def compute_reward(self, batch):
        return [float(f"{self.phrase} {rm['ground_truth']}" in p)
                for p, rm in zip(batch["prompts"], batch["reward_model"])]
'''


def _train_one_step(rank, world_size, config, overrides):
    from verl_mcore.config import Config, validate
    from verl_mcore.trainer import Trainer

    cfg = Config.load(config, overrides)
    validate(cfg, world_size)
    return Trainer(cfg).fit()


def test_the_trainer_runs_a_batch_class_in_workers_and_logs_routes(tmp_path):
    """One real step: the prompts are decoded from the rollout's ids for the class, which runs in
    a scoring worker; reward/route/copy/* covers the whole batch."""
    import json

    from tests.e2e.test_trainer import ROOT, _overrides
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    path = tmp_path / "prompt_reader.py"
    path.write_text(PROMPT_READER)
    overrides = _overrides(model, tmp_path / "run", "grpo", (1, 1, 1)) + [
        "trainer.total_steps=1", "trainer.val_every=0", "reward.custom_fn.path=null",
        "reward.custom_fn.name=null", f"reward.custom_cls.path={path}",
        "reward.custom_cls.name=DigitInPrompt", "reward.custom_cls.kwargs={phrase: repeat the digit}",
        "reward.num_workers=1", "reward.route_by=ability", "reward.max_failed_fraction=0.0"]
    config = str(ROOT / "configs/quickstart.yaml")
    assert run_on_ranks(_train_one_step, 1, args=(config, overrides), timeout=300,
                        fresh=True) == [0]
    [metrics] = [json.loads(line) for line in
                 (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["reward/rule/mean"] == 1.0 and metrics["reward/failed"] == 0
    assert metrics["reward/route/copy/count"] == 8.0 and metrics["reward/route/copy/mean"] == 1.0
