"""tools.convert_hf on mixture-of-experts models (qwen2_moe with a dense layer among MoE layers,
qwen3_moe, mixtral): HF -> mcore -> HF is bit-exact; the dist checkpoint has exactly the keys,
shapes and chunks megatron's own sharded_state_dict describes; it loads at EP=2 (with TP=2, and
PP=2 in the slow tier) to logits equal to transformers'; a checkpoint megatron saves at EP=2
exports back to the original HF tensors; `verify --ep 2` passes."""
from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.models import hf_factory, moe_bodies
from tests.multiproc import run_on_ranks
from tools.convert_hf.convert import convert_hf_to_mcore, convert_mcore_to_hf
from tools.convert_hf.verify import prompts, transformers_logits, verify
from verl_mcore.convert_hf.dist_ckpt import DistCheckpointReader

VOCAB = hf_factory.COMMON["vocab_size"]
TOL = 1e-4


def _state(hf_dir) -> dict[str, torch.Tensor]:
    out = {}
    for path in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (HF dir, converted dist checkpoint)}."""
    root = tmp_path_factory.mktemp("moe_convert")
    out = {}
    for family in hf_factory.MOE_FAMILIES:
        src = hf_factory.save_tiny_model(family, str(root / family), seed=3)
        out[family] = (src, convert_hf_to_mcore(src, str(root / f"{family}.mcore"),
                                                progress=False))
    return out


@pytest.mark.parametrize("family", hf_factory.MOE_FAMILIES)
def test_round_trip_is_bit_exact(converted, tmp_path, family):
    src, ckpt = converted[family]
    back = convert_mcore_to_hf(ckpt, str(tmp_path / "back"), progress=False,
                               max_shard_bytes=150_000)
    a, b = _state(src), _state(back)
    assert sorted(a) == sorted(b)
    assert any(".experts.3." in k for k in a), "the experts are in the comparison"
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("family", hf_factory.MOE_FAMILIES)
def test_checkpoint_keys_are_megatrons(converted, family):
    src, ckpt = converted[family]
    ours = {}
    for key, md in DistCheckpointReader(ckpt).metadata.state_dict_metadata.items():
        chunks = getattr(md, "chunks", None)
        ours[key] = (None, []) if chunks is None else (
            tuple(md.size), sorted(tuple(c.offsets) for c in chunks))
    theirs = run_on_ranks(moe_bodies.sharded_keys_body, 1, args=(src,), timeout=240)[0]
    theirs = {k: (shape, sorted(offsets)) for k, (shape, offsets) in theirs.items()}
    assert sorted(set(ours) ^ set(theirs)) == []
    assert {k: v for k, v in ours.items() if theirs[k] != v} == {}


@pytest.mark.parametrize("family", hf_factory.MOE_FAMILIES)
@pytest.mark.parametrize("tp,pp,ep,etp,world", [(1, 1, 2, None, 2), (2, 1, 2, 1, 2),
                                                pytest.param(1, 2, 2, None, 4,
                                                             marks=pytest.mark.slow)],
                         ids=["ep2", "tp2_ep2_etp1", "pp2_ep2"])
def test_checkpoint_loads_at_expert_parallel_layouts(converted, family, tp, pp, ep, etp, world):
    src, ckpt = converted[family]
    tokens = prompts(VOCAB, batch=2, seq_len=12)
    ref = transformers_logits(src, tokens)
    results = run_on_ranks(moe_bodies.logits_body, world,
                           args=(src, tp, pp, ep, etp, tokens, ckpt), timeout=300)
    outs = [r["out"] for r in results if r["out"] is not None]
    assert outs
    for out in outs:
        assert ((out[..., :VOCAB] - ref).abs().max() / ref.abs().max()).item() <= TOL


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_megatron_saved_expert_parallel_checkpoint_exports_to_the_hf_tensors(
        converted, tmp_path, family):
    src, _ = converted[family]
    saved = str(tmp_path / "saved")
    run_on_ranks(moe_bodies.save_body, 2, args=(src, 1, 2, saved), timeout=300)
    back = convert_mcore_to_hf(saved, str(tmp_path / "back"), hf_template=src, progress=False)
    a, b = _state(src), _state(back)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_verify_at_ep2(converted):
    src, ckpt = converted["qwen3_moe"]
    diff = verify(src, ckpt, ep=2)
    assert diff["max_rel"] <= TOL
