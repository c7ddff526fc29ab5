"""Bad reward models are refused before any model is built, naming the source's config key:
a path that is no model, a causal LM or a multi-label classifier, weights without a `score`
head, damaged weights, a tokenizer with more ids than the model's embeddings, a tokenizer that
turns text into nothing, sequences longer than the model's positions, a micro-batch budget
below one sequence; and the planner says the same instead of a traceback."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from verl_mcore import build
from verl_mcore.config import Config, ConfigError, validate


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("bad_rms")
    return (make_tiny_model(str(root / "actor")),
            make_tiny_model(str(root / "rm"), seed=1, reward_model=True), root)


def _variant(root, rm, name, edit):
    out = root / name
    if not out.exists():
        shutil.copytree(rm, out)
        edit(str(out))
    return str(out)


def _edit_config(**changes):
    def edit(d):
        path = os.path.join(d, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(changes)
        with open(path, "w") as f:
            json.dump(cfg, f)
    return edit


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(actor, rm_path, source_extra=""):
    cfg = Config.load(os.path.join(ROOT, "configs/quickstart.yaml"), [
        f"model.path={actor}", "data.max_prompt_length=16", "data.max_response_length=16",
        "reward.sources=[{name: rm, type: reward_model, path: " + rm_path + source_extra + "}]"])
    validate(cfg, 1)
    info = build.load_model_info(cfg)
    key, source = build.reward_model_sources(cfg)[0]
    build.check_reward_model_tokens(cfg, info, key, build.reward_model_info(cfg, key, source))


def _truncate(d):
    f = os.path.join(d, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 200)


def _causal_weights(actor):
    def edit(d):
        for name in os.listdir(actor):
            if name.endswith(".safetensors"):
                shutil.copy(os.path.join(actor, name), os.path.join(d, name))
    return edit


def _tokenizer_of_nothing(d):
    from tokenizers import Tokenizer, models as tok_models
    from transformers import PreTrainedTokenizerFast

    # A word-level vocabulary of three words: any other text is <unk>, then stripped.
    tok = Tokenizer(tok_models.WordLevel(vocab={"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    for name in os.listdir(d):
        if name.startswith("tokenizer") or name.endswith(".jinja") or name in ("vocab.json", "merges.txt"):
            os.remove(os.path.join(d, name))
    fast.save_pretrained(d)
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)


CASES = {
    "a file": (lambda root, rm, actor: str(root / "actor" / "config.json"), "no such directory"),
    "an empty directory": (lambda root, rm, actor: str(_mkdir(root / "empty")),
                           "neither an HF directory"),
    "a causal LM": (lambda root, rm, actor: actor, "no *ForSequenceClassification"),
    "two labels": (lambda root, rm, actor: _variant(root, rm, "labels2", _edit_config(
        id2label={"0": "bad", "1": "good"})), "2 labels"),
    "no score weight": (lambda root, rm, actor: _variant(root, rm, "noscore", _causal_weights(actor)),
                        "no `score.weight`"),
    "cut weights": (lambda root, rm, actor: _variant(root, rm, "cut", _truncate),
                    "(reward.sources[0].path)"),
    "bad config.json": (lambda root, rm, actor: _variant(
        root, rm, "badjson", lambda d: open(os.path.join(d, "config.json"), "w").write("{oops")),
                        "reward.sources[0].path"),
    "small vocabulary": (lambda root, rm, actor: _variant(root, rm, "smallvocab", _edit_config(
        vocab_size=20)), "36 ids but the model only 20 embeddings"),
    "short positions": (lambda root, rm, actor: _variant(root, rm, "shortpos", _edit_config(
        max_position_embeddings=8)), "more than the reward model's max_position_embeddings=8"),
    "a tokenizer of nothing": (lambda root, rm, actor: _variant(root, rm, "nothing", _tokenizer_of_nothing),
                               "does not read text back"),
}


def _mkdir(path):
    path.mkdir(exist_ok=True)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_reward_model_refused_naming_its_key(models, case):
    actor, rm, root = models
    make, fragment = CASES[case]
    with pytest.raises(ConfigError) as e:
        _check(actor, make(root, rm, actor))
    assert fragment in str(e.value), str(e.value)
    assert "reward.sources[0]" in str(e.value), str(e.value)
    assert "model.path" not in str(e.value).replace("model.path=" + actor, ""), str(e.value)


def test_good_reward_model_passes_and_budget_below_a_sequence_is_refused(models):
    actor, rm, _ = models
    _check(actor, rm)
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].max_tokens_per_microbatch=3 is "
                                          r"smaller than the longest sequence"):
        _check(actor, rm, ", max_tokens_per_microbatch: 3")


def test_planner_names_a_bad_reward_model_path(models, capsys):
    from verl_mcore import plan

    actor, _, root = models
    code = plan.main(["--config", os.path.join(ROOT, "configs/quickstart.yaml"), f"model.path={actor}",
                      f"reward.sources=[{{name: rm, type: reward_model, path: {root}/nope}}]"])
    err = capsys.readouterr().err
    assert code != 0 and "reward.sources[0].path" in err and "Traceback" not in err
    code = plan.main(["--config", os.path.join(ROOT, "configs/quickstart.yaml"), f"model.path={actor}",
                      f"reward.sources=[{{name: rm, type: reward_model, path: {actor}}}]"])
    assert code != 0 and "ForSequenceClassification" in capsys.readouterr().err
