"""Generation stops where transformers' generate stops: at the tokenizer's EOS and at every
eos_token_id of generation_config.json (Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>;
before this the engine stopped only at the tokenizer's and ran on past the other)."""
import json

import pytest

from verl_mcore import build
from verl_mcore.config import Config
from verl_mcore.models.hf_config import generation_eos_ids
from verl_mcore.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_model(out)
    return out


def _info(path):
    return build.load_model_info(Config.load(None, [f"model.path={path}"]))


def test_every_eos_of_generation_config_stops(tiny, tmp_path):
    info = _info(tiny)
    eos = info.tokenizer.eos_token_id
    assert info.eos_token_ids[0] == eos
    with open(f"{tiny}/generation_config.json") as f:
        gen = json.load(f)
    gen["eos_token_id"] = [7, eos, 9]
    with open(f"{tiny}/generation_config.json", "w") as f:
        json.dump(gen, f)
    info = _info(tiny)
    # The tokenizer's EOS first (it also pads the rollout batch), then the others in order.
    assert info.eos_token_ids == [eos, 7, 9]
    assert info.pad_token_id == (info.tokenizer.pad_token_id if info.tokenizer.pad_token_id is not None else eos)


def test_one_id_none_and_no_file(tmp_path):
    assert generation_eos_ids(str(tmp_path)) == ()
    assert generation_eos_ids(None) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert generation_eos_ids(str(tmp_path)) == (5,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert generation_eos_ids(str(tmp_path)) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        generation_eos_ids(str(tmp_path))
