"""hf-to-mcore reads what transformers reads, and checks it before writing anything: the weight
file transformers would load, dtypes it can convert, shapes config.json implies, damaged files
named, and unused tensors warned of (found by a hostile review of tools/convert_hf)."""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models import hf_factory
from verl_mcore.config import ConfigError
from verl_mcore.convert_hf.__main__ import main as cli
from verl_mcore.convert_hf.convert import convert_hf_to_mcore
from verl_mcore.models.hf_weights import HFCheckpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A sharded tiny Llama (index + shards), written once; each test edits a copy."""
    return hf_factory.save_tiny_model("llama2", str(tmp_path_factory.mktemp("src") / "llama"), seed=1)


@pytest.fixture
def model(source, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(source, dst)
    return str(dst)


def _index(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"]


def _edit(d, name, fn):
    """Replace tensor `name` (in whichever shard holds it) by fn(tensor); fn may return None to
    drop it, or a dict of extra tensors to add next to it."""
    shard = os.path.join(d, _index(d)[name])
    tensors = load_file(shard)
    out = fn(tensors[name])
    if isinstance(out, dict):
        tensors.update(out)
        index_path = os.path.join(d, "model.safetensors.index.json")
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"].update({k: os.path.basename(shard) for k in out})
        with open(index_path, "w") as f:
            json.dump(index, f)
    else:
        tensors[name] = out
    save_file(tensors, shard, metadata={"format": "pt"})


def _all_tensors(d):
    out = {}
    for fn in sorted(set(_index(d).values())) if os.path.isfile(
            os.path.join(d, "model.safetensors.index.json")) else ["model.safetensors"]:
        out.update(load_file(os.path.join(d, fn)))
    return out


def test_single_file_wins_over_a_stale_index_as_in_transformers(model, tmp_path):
    """save_pretrained unsharded into a folder that held a sharded save leaves the old index
    (and here its old shards): transformers loads model.safetensors; so must we."""
    fresh = {k: v + 1 for k, v in _all_tensors(model).items()}
    save_file(fresh, os.path.join(model, "model.safetensors"), metadata={"format": "pt"})
    ckpt = HFCheckpoint(model)
    assert set(ckpt.files.values()) == {os.path.join(model, "model.safetensors")}
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(ckpt.read(name), fresh[name])
    for shard in set(_index(model).values()):  # the stale shards gone: the index alone is left
        os.remove(os.path.join(model, shard))
    convert_hf_to_mcore(model, str(tmp_path / "out"), progress=False)


@pytest.mark.parametrize("dtype,ok", [(torch.float64, True), (torch.int8, False),
                                      (torch.float8_e4m3fn, False)])
def test_dtypes(model, tmp_path, dtype, ok):
    """F64 converts (written as F32); integer and FP8 weights, a quantised checkpoint whose
    scales we do not read, are refused by tensor and file before anything is written."""
    name = "model.layers.1.mlp.down_proj.weight"
    _edit(model, name, lambda t: t.to(dtype))
    out = tmp_path / "out"
    if ok:
        convert_hf_to_mcore(model, str(out), progress=False)
        return
    with pytest.raises(ConfigError, match=f"{_index(model)[name]}: tensor '{name}' is .*quantised"):
        convert_hf_to_mcore(model, str(out), progress=False)
    assert not os.path.exists(out) and os.listdir(tmp_path) == ["model"]


@pytest.mark.parametrize("name,shape", [("model.layers.0.input_layernorm.weight", (65,)),
                                        ("model.embed_tokens.weight", (240, 64)),
                                        ("model.layers.2.self_attn.k_proj.weight", (16, 64))])
def test_shapes_that_contradict_config_fail_first(model, tmp_path, name, shape):
    _edit(model, name, lambda t: torch.zeros(shape))
    with pytest.raises(ConfigError, match=f"'{name}' in .* is {re.escape(str(list(shape)))}, "
                                          "config.json implies"):
        convert_hf_to_mcore(model, str(tmp_path / "out"), progress=False)
    assert os.listdir(tmp_path) == ["model"]


def test_a_cut_shard_is_named_before_anything_is_written(model, tmp_path, capsys):
    shard = os.path.join(model, sorted(set(_index(model).values()))[-1])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    assert cli(["hf-to-mcore", "--hf", model, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {shard}: the safetensors file is incomplete or damaged") and "--hf" in err
    assert os.listdir(tmp_path) == ["model"]


def test_unused_tensors_are_warned_of(model, tmp_path):
    extra = {"model.layers.0.self_attn.q_proj.bias": torch.ones(64),
             "model.layers.7.mlp.up_proj.weight": torch.ones(96, 64)}
    _edit(model, "model.layers.0.self_attn.q_proj.weight", lambda t: extra)
    with pytest.warns(UserWarning, match=r"2 tensors are not used by a llama of 4 layers.*"
                                         r"model.layers.0.self_attn.q_proj.bias"):
        convert_hf_to_mcore(model, str(tmp_path / "out"), progress=False)


def test_a_clean_checkpoint_warns_of_nothing(model, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_hf_to_mcore(model, str(tmp_path / "out"), progress=False)
    assert not [w for w in caught if "not used by" in str(w.message)]
