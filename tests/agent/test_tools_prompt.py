"""data.tools in the dataset's prompts (data/chat.py ToolPrompt through RLHFDataset) against the
prompt-length limit: the tools' description sits at the start of the prompt, so a left cut would
silently take the tools away from the model; it is refused, and a too-long prompt's error says
the description is part of its length."""
from __future__ import annotations

import pytest

from tests.agent.chatml_tokenizer import make_chatml_tokenizer
from tests.agent.test_observation import SCHEMA
from tests.data.files import gsm8k_rows, write_rows
from verl_mcore.config.schema import DataConfig
from verl_mcore.data import DataError, RLHFDataset


@pytest.fixture(scope="module")
def tok():
    return make_chatml_tokenizer()


@pytest.fixture()
def path(tmp_path):
    return write_rows(str(tmp_path / "a.jsonl"), gsm8k_rows(4), "jsonl")


def _limit(tok, path):
    """A max_prompt_length that every prompt fits without the tools and none with them."""
    plain = RLHFDataset(path, tok, DataConfig(max_prompt_length=4096))
    tooled = RLHFDataset(path, tok, DataConfig(max_prompt_length=4096, tools=[SCHEMA]))
    longest = max(len(plain.prompt_ids(i)) for i in range(len(plain)))
    assert min(len(tooled.prompt_ids(i)) for i in range(len(tooled))) > longest + 10
    assert "calculator" in tok.decode(tooled.prompt_ids(0))
    return longest + 5


def test_a_left_cut_that_would_drop_the_tools_is_refused(tok, path):
    cfg = DataConfig(max_prompt_length=_limit(tok, path), truncation="truncate_left",
                     tools=[SCHEMA])
    with pytest.raises(DataError, match=r"truncate_left would cut .*data\.tools"):
        RLHFDataset(path, tok, cfg)


def test_a_too_long_prompt_says_the_tools_take_part_of_it(tok, path):
    cfg = DataConfig(max_prompt_length=_limit(tok, path), tools=[SCHEMA])
    with pytest.raises(DataError, match=r"data\.tools"):
        RLHFDataset(path, tok, cfg)


def test_nothing_left_after_the_filter_names_the_tools(tok, path):
    cfg = DataConfig(max_prompt_length=_limit(tok, path), truncation="filter", tools=[SCHEMA])
    with pytest.raises(DataError, match=r"include the tools' description") as e:
        RLHFDataset(path, tok, cfg)
    assert "truncate_left" not in str(e.value)


def test_data_tools_are_checked_as_tool_schemas(tok):
    """data.tools given by hand: a schema of the wrong shape fails naming its place, before any
    prompt shows it (the template would print it as it is)."""
    from types import SimpleNamespace

    from verl_mcore.build import build_datasets
    from verl_mcore.config import Config

    cfg = Config.load("configs/quickstart.yaml", ["data.val_files=[]",
                                                  "data.tools=[{name: calc}]"])
    with pytest.raises(ValueError, match=r"data\.tools\[0\]: a tool schema is"):
        build_datasets(cfg, SimpleNamespace(tokenizer=tok))
