"""Reward sources: custom functions, routing with a default, weighting, reward models.
Scoring in-process here (reward.num_workers=0); test_isolation.py covers the worker pool."""
import pytest

from tests.reward import user_fns
from verl_mcore.config.schema import CustomClassConfig, RewardConfig, RewardSourceConfig
from verl_mcore.reward import RewardManager


def row(category=None, data_source="openai/gsm8k", truth="72", **extra):
    r = {"data_source": data_source, "reward_model": {"style": "rule", "ground_truth": truth},
         "extra_info": {"index": 7}, "prompt": "q"}
    if category is not None:
        r["category"] = category
    r.update(extra)
    return r


class FakeRM:
    """Stands in for the megatron value-head model: score = number of response tokens."""

    def __init__(self):
        self.calls = []

    def score_batch(self, prompt_ids, response_ids):
        self.calls.append((list(prompt_ids), list(response_ids)))
        return [float(len(r)) for r in response_ids]


def manager(**kw):
    return RewardManager.from_config(RewardConfig(num_workers=0, **kw), kw.pop("models", None))


def test_default_is_the_builtin_dispatch():
    with manager() as m:
        out = m.score(["#### 72", "#### 71", r"\boxed{\frac12}"],
                      [row(), row(), row(data_source="lighteval/MATH", truth="0.5")])
    assert out.scores == [1.0, 0.0, 1.0] and out.source_scores == {"rule": [1.0, 0.0, 1.0]}
    assert out.metrics["reward/rule/mean"] == pytest.approx(2 / 3)
    assert out.metrics["reward/errors"] == 0 and out.metrics["reward/timeouts"] == 0


def test_custom_fn_from_a_file_with_kwargs(tmp_path):
    cfg = dict(custom_fn=CustomClassConfig(path=user_fns.write(tmp_path), name="length_reward"),
               custom_fn_kwargs={"scale": 0.5})
    with manager(**cfg) as m:
        out = m.score(["abcd", "ab"], [row(), row()])
    assert out.scores == [2.0, 1.0]
    assert out.extras == {"rule/chars": [4.0, 2.0]} and out.metrics["reward/rule/chars/mean"] == 3.0


def test_extra_columns_reach_the_scorer(tmp_path):
    cfg = dict(custom_fn=CustomClassConfig(path=user_fns.write(tmp_path), name="echo_category"))
    with manager(**cfg) as m:
        assert m.score(["x", "y"], [row("chat"), row("math")]).scores == [100.0, -1.0]
    args = RewardManager.scorer_args("resp", row("chat", ability="math"))
    assert args[:3] == ("openai/gsm8k", "resp", "72")
    assert args[3] == {"index": 7, "category": "chat", "ability": "math", "prompt": "q"}


def test_routing_by_a_column_with_a_default(tmp_path):
    path = user_fns.write(tmp_path)
    cfg = dict(route_by="category",
               routes={"math": "lighteval/MATH", "chat": "judge"},
               default_route="openai/gsm8k",
               sources=[RewardSourceConfig(name="rule"),
                        RewardSourceConfig(name="judge", type="custom", path=path,
                                           function="length_reward")])
    responses = [r"\boxed{72}", "hello", "#### 72", "#### 72", r"\boxed{72}"]
    rows = [row("math"), row("chat"), row("code"), row(None), row("code")]
    with manager(**cfg) as m:
        out = m.score(responses, rows)
    # math -> MATH scorer; chat -> the judge source; code and missing -> the default (GSM8K)
    assert out.scores == [1.0, 5.0, 1.0, 1.0, 0.0]
    # a route target is not a term of its own
    assert list(out.source_scores) == ["rule"]


def test_routing_without_default_falls_back_to_the_data_source():
    cfg = dict(route_by="category", routes={"math": "lighteval/MATH"})
    with manager(**cfg) as m:
        out = m.score([r"\boxed{72}", "#### 72", r"\boxed{72}"],
                      [row("math"), row("other"), row("other", data_source="lighteval/MATH")])
    assert out.scores == [1.0, 1.0, 1.0]


def test_weighted_sources_are_logged_one_by_one(tmp_path):
    path = user_fns.write(tmp_path)
    rm = FakeRM()
    cfg = dict(sources=[RewardSourceConfig(name="correct", weight=1.0),
                        RewardSourceConfig(name="length", weight=-0.1, type="custom", path=path,
                                           function="length_reward", kwargs={"scale": 1.0}),
                        RewardSourceConfig(name="rm", weight=0.5, type="reward_model",
                                           path="ckpt/rm")])
    m = RewardManager.from_config(RewardConfig(num_workers=0, **cfg), reward_models={"rm": rm})
    out = m.score(["#### 72", "#### 7"], [row(), row()], prompt_ids=[[1, 2], [3]],
                  response_ids=[[5, 6, 7], [8]])
    assert out.source_scores == {"correct": [1.0, 0.0], "length": [7.0, 6.0], "rm": [3.0, 1.0]}
    assert out.scores == pytest.approx([1.0 - 0.7 + 1.5, 0.0 - 0.6 + 0.5])
    assert out.metrics["reward/correct/mean"] == 0.5 and out.metrics["reward/rm/mean"] == 2.0
    assert out.metrics["reward/length/mean"] == 6.5
    assert out.metrics["reward/score/mean"] == pytest.approx((1.8 - 0.1) / 2)
    assert rm.calls == [([[1, 2], [3]], [[5, 6, 7], [8]])]
    with pytest.raises(ValueError, match="pass prompt_ids and response_ids"):
        m.score(["#### 72"], [row()])


def test_route_to_a_reward_model_scores_only_its_samples():
    rm = FakeRM()
    cfg = RewardConfig(num_workers=0, route_by="category", routes={"chat": "rm"},
                       sources=[RewardSourceConfig(name="rule"),
                                RewardSourceConfig(name="rm", type="reward_model")])
    m = RewardManager.from_config(cfg, reward_models={"rm": rm})
    out = m.score(["#### 72", "hi", "#### 72"], [row("math"), row("chat"), row("math")],
                  prompt_ids=[[1], [2], [3]], response_ids=[[1], [4, 4], [1]])
    assert out.scores == [1.0, 2.0, 1.0] and rm.calls == [([[2]], [[4, 4]])]


@pytest.mark.parametrize("cfg,problem", [
    (dict(route_by="category", routes={"x": "nope"}), r"reward.routes.x='nope' is neither"),
    (dict(route_by="category", default_route="nope"), r"reward.default_route='nope'"),
    (dict(routes={"x": "openai/gsm8k"}), "reward.route_by .* is not"),
    (dict(route_by="category", sources=[RewardSourceConfig(name="rm", type="reward_model")]),
     "reward_models=.*'rm'"),
    (dict(sources=[RewardSourceConfig(name="a"), RewardSourceConfig(name="a")]), "duplicate"),
    (dict(custom_fn=CustomClassConfig(path="/no/such/file.py", name="f")), "no such file"),
    (dict(sources=[RewardSourceConfig(name="c", type="custom", path="PATH", function="missing")]),
     r"reward.sources\[0\].function='missing'"),
])
def test_config_errors_name_the_key(tmp_path, cfg, problem):
    for s in cfg.get("sources", []):
        if s.path == "PATH":
            s.path = user_fns.write(tmp_path)
    with pytest.raises((ValueError, TypeError), match=problem):
        RewardManager.from_config(RewardConfig(num_workers=0, **cfg))


def test_route_by_needs_a_rule_source(tmp_path):
    cfg = RewardConfig(num_workers=0, route_by="category",
                       sources=[RewardSourceConfig(name="c", type="custom",
                                                   path=user_fns.write(tmp_path),
                                                   function="length_reward")])
    with pytest.raises(ValueError, match="no source of type 'rule'"):
        RewardManager.from_config(cfg)


def test_in_process_errors_fall_back(tmp_path):
    cfg = dict(custom_fn=CustomClassConfig(path=user_fns.write(tmp_path), name="flaky"),
               fallback_score=-1.0)
    with manager(**cfg) as m:
        out = m.score(["ok 3", "raise", "ok 4"], [row()] * 3)
    assert out.scores == [3.0, -1.0, 4.0] and out.failed == [False, True, False]
    assert out.metrics["reward/errors"] == 1


def test_check_dataset_before_training(tmp_path):
    from tests.data.files import gsm8k_rows, write_rows
    from tests.data.tiny_tokenizer import make_tiny_tokenizer
    from verl_mcore.config.schema import DataConfig
    from verl_mcore.data import RLHFDataset

    rows = gsm8k_rows(4)
    rows[1]["data_source"], rows[1]["category"] = "my/chat", "chat"
    rows[2]["data_source"] = None
    path = write_rows(str(tmp_path / "a.parquet"), rows, "parquet")
    ds = RLHFDataset(path, make_tiny_tokenizer(), DataConfig())
    with manager() as m, pytest.raises(ValueError, match=r"data_source \[None, 'my/chat'\]"):
        m.check_dataset(ds)
    # routed elsewhere (or a custom function) -> nothing left for the dispatch to miss
    with manager(route_by="category", routes={"chat": "lighteval/MATH"},
                 default_route="openai/gsm8k") as m:
        m.check_dataset(ds)
    with manager(route_by="category", routes={"chat": "lighteval/MATH"}) as m:
        with pytest.raises(ValueError, match=r"data_source \[None\]"):
            m.check_dataset(ds)


def test_dapo_sources_score_plus_minus_one_with_acc(tmp_path):
    from tests.data.files import gsm8k_rows, write_rows
    from tests.data.tiny_tokenizer import make_tiny_tokenizer
    from verl_mcore.config.schema import DataConfig
    from verl_mcore.data import RLHFDataset

    def dataset(*sources):
        rows = [dict(r, data_source=s) for r, s in zip(gsm8k_rows(len(sources)), sources)]
        path = write_rows(str(tmp_path / f"{len(sources)}.parquet"), rows, "parquet")
        return RLHFDataset(path, make_tiny_tokenizer(), DataConfig())

    with manager() as m:
        m.check_dataset(dataset("math", "aime_2024", "openai/gsm8k"))  # all built in, as in verl
        out = m.score(["Answer: 72", "Answer: 7"],
                      [row(data_source="math"), row(data_source="aime_2024")])
        assert out.scores == [1.0, -1.0] and out.extras == {"rule/acc": [1.0, 0.0]}
        # "gsm8k" was ours alone; verl knows only "openai/gsm8k", and so do we now
        with pytest.raises(ValueError, match=r"data_source \['gsm8k'\].*'aime\*'"):
            m.check_dataset(dataset("math", "gsm8k"))
