"""Checkpoints megatron itself writes at one layout load at another through our builder.

FINDINGS once saw "Invalid access pattern" loading a TP=2 checkpoint at PP=2; with the layer
offsets megatron derives from each layer's global number, both directions load exactly.
"""
from __future__ import annotations

import pytest

from tests.models import hf_factory, parity_bodies
from tests.multiproc import run_on_ranks
from tools.convert_hf.verify import prompts, transformers_logits


@pytest.mark.slow
def test_megatron_saved_checkpoint_reshards_between_tp2_and_pp2(tmp_path):
    hf_dir = hf_factory.save_tiny_model("qwen3", str(tmp_path / "hf"), seed=4)
    tokens = prompts(hf_factory.COMMON["vocab_size"], seq_len=10)
    ref = transformers_logits(hf_dir, tokens)
    for (save_tp, save_pp), (load_tp, load_pp) in [((2, 1), (1, 2)), ((1, 2), (2, 1))]:
        ckpt = str(tmp_path / f"ckpt_tp{save_tp}_pp{save_pp}")
        run_on_ranks(parity_bodies.save_body, 2, args=(hf_dir, save_tp, save_pp, ckpt),
                     timeout=240)
        results = run_on_ranks(parity_bodies.logits_body, 2,
                               args=(hf_dir, "ckpt", load_tp, load_pp, "actor", tokens, ckpt),
                               timeout=240)
        ours = [r["out"] for r in results if r["out"] is not None][0][..., :ref.shape[-1]]
        rel = ((ours - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-4, ((save_tp, save_pp), (load_tp, load_pp), rel)


def test_critic_checkpoint_resumes_its_head(tmp_path):
    hf_dir = hf_factory.save_tiny_model("qwen2", str(tmp_path / "hf"), seed=2)
    restored, was_different = run_on_ranks(parity_bodies.critic_resume_body, 1,
                                           args=(hf_dir, str(tmp_path / "critic")),
                                           timeout=240)[0]
    assert was_different and restored
