"""megatron-core GPTModel built from tiny HF checkpoints vs transformers (fp32, <= 1e-4 relative).

TP=1 on one rank for every family (weights read straight from the HF directory, and once through
a converted dist checkpoint), TP=2 and PP=2 on two gloo ranks, the critic / reward-model heads,
and packed (THD) sequences through the SDPA core attention.
"""
from __future__ import annotations

import pytest
import torch

from tests.models import hf_factory, parity_bodies
from tests.multiproc import run_on_ranks
from tools.convert_hf.verify import prompts, transformers_logits

TOL = 1e-4
VOCAB = hf_factory.COMMON["vocab_size"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {f: hf_factory.save_tiny_model(f, str(root / f), seed=i)
            for i, f in enumerate(hf_factory.FAMILIES)}
    dirs["qwen2_rm"] = hf_factory.save_tiny_model("qwen2", str(root / "qwen2_rm"), seed=7,
                                                  seq_cls=True)
    return dirs


@pytest.fixture(scope="module")
def tokens():
    return prompts(VOCAB, batch=2, seq_len=12)


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def _run(hf_dir, source, tp, pp, role, tokens, ckpt_dir=None, core_attention="sdpa"):
    results = run_on_ranks(parity_bodies.logits_body, tp * pp,
                           args=(hf_dir, source, tp, pp, role, tokens, ckpt_dir, core_attention),
                           timeout=240)
    out = [r["out"] for r in results if r["out"] is not None]
    assert len(out) == 1, "exactly one rank (last stage, TP rank 0) returns the outputs"
    return out[0], results


@pytest.mark.parametrize("family", hf_factory.FAMILIES)
def test_tp1_matches_transformers(hf_dirs, tokens, family):
    ref = transformers_logits(hf_dirs[family], tokens)
    ours, _ = _run(hf_dirs[family], "hf", 1, 1, "actor", tokens)
    assert ours.shape[-1] == 256  # 250 padded to a multiple of 128
    assert torch.all(ours[..., VOCAB:] == 0), "padding rows of the vocabulary give zero logits"
    assert _rel(ours[..., :VOCAB], ref) <= TOL


def test_local_core_attention_matches_too(hf_dirs, tokens):
    """megatron's own DotProductAttention (the 'local' option, used by the bench) agrees."""
    ref = transformers_logits(hf_dirs["llama31"], tokens)
    ours, _ = _run(hf_dirs["llama31"], "hf", 1, 1, "actor", tokens, core_attention="local")
    assert _rel(ours[..., :VOCAB], ref) <= TOL


@pytest.mark.parametrize("family", ["llama31", "qwen2", "qwen3", "qwen2_untied"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tp2_pp2_from_hf_dir_match_transformers(hf_dirs, tokens, family, tp, pp):
    ref = transformers_logits(hf_dirs[family], tokens)
    ours, results = _run(hf_dirs[family], "hf", tp, pp, "actor", tokens)
    assert _rel(ours[..., :VOCAB], ref) <= TOL
    # Each rank read only its own slice of the HF weights: well under the whole model.
    total = sum(t.numel() * 4 for t in _hf_state(hf_dirs[family]).values())
    for r in results:
        assert r["read_bytes"] < 0.7 * total, (r["read_bytes"], total)


def test_uneven_pipeline_stages(hf_dirs, tokens):
    """PP=2 with 1 layer on the first stage and 3 on the last (megatron's uneven split)."""
    ref = transformers_logits(hf_dirs["qwen3"], tokens)
    results = run_on_ranks(parity_bodies.logits_body, 2,
                           args=(hf_dirs["qwen3"], "hf", 1, 2, "actor", tokens, None, "sdpa",
                                 {"num_layers_in_first_pipeline_stage": 1}), timeout=240)
    ours = [r["out"] for r in results if r["out"] is not None][0]
    assert _rel(ours[..., :VOCAB], ref) <= TOL
    # The first stage read 1 of 4 layers (plus the embedding), the last stage 3 (plus the head).
    assert results[0]["read_bytes"] < results[1]["read_bytes"]


def _hf_state(hf_dir):
    from verl_mcore.models.hf_weights import HFCheckpoint

    ckpt = HFCheckpoint(hf_dir)
    return {n: ckpt.read(n) for n in ckpt.names()}


def test_reward_model_from_sequence_classification(hf_dirs, tokens):
    """RM trunk + HF `score` head: per-token scores equal transformers' score(hidden)."""
    ref = transformers_logits(hf_dirs["qwen2_rm"], tokens)  # [b, s, 1]
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        ours, _ = _run(hf_dirs["qwen2_rm"], "hf", tp, pp, "reward", tokens)
        assert ours.shape == ref.shape == (2, 12, 1)
        assert _rel(ours, ref) <= TOL, (tp, pp)


def test_critic_from_actor_checkpoint_has_fresh_head(hf_dirs, tokens, tmp_path):
    """Critic = actor trunk + new scalar head: values = final hidden states @ head. Built from
    the HF dir, and from a converted actor checkpoint alone."""
    import transformers

    from tools.convert_hf.convert import convert_hf_to_mcore

    hf_dir = hf_dirs["qwen2"]
    ckpt = convert_hf_to_mcore(hf_dir, str(tmp_path / "actor.mcore"), progress=False)
    for source, tp, pp in [("hf", 1, 1), ("hf", 1, 2), ("ckpt_only", 2, 1)]:
        ours, results = _run(hf_dir, source, tp, pp, "critic", tokens, ckpt_dir=ckpt)
        head = [r["head"] for r in results if r["head"] is not None][0]  # [1, H]
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        with torch.no_grad():
            hidden = model.model(input_ids=tokens).last_hidden_state  # [b, s, H], after final norm
        ref = hidden @ head.T
        assert ours.shape == (2, 12, 1)
        assert head.abs().sum() > 0, "the head is initialised, not zero"
        assert _rel(ours, ref) <= TOL


def test_packed_sequences_match_separate_runs(hf_dirs):
    """THD packing with cu_seqlens (SDPA per sequence on CPU) == each sequence alone, and our
    sync-free packed RoPE (models/rope.py) == megatron's own, bit for bit."""
    res = run_on_ranks(parity_bodies.packed_body, 1, args=(hf_dirs["qwen3"], [5, 1, 9, 3]),
                       timeout=120)[0]
    assert res["packed"].shape == res["alone"].shape == (18, 256)
    assert _rel(res["packed"], res["alone"]) <= 1e-5
    assert torch.equal(res["packed"], res["megatron_rope"])
