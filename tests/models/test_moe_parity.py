"""Mixture-of-experts models (qwen2_moe, qwen3_moe, mixtral) built by megatron-core's local spec
from tiny HF checkpoints, against transformers (fp32, <= 1e-4 relative like the dense families):
on one rank, and at EP=2 composed with TP=2 (expert TP 1 and 2) and PP=2 on gloo ranks.

The router semantics each family maps to (MoESpec) are what these logits prove: a wrong
pre-softmax / renormalisation choice, a dropped shared-expert gate or a misnumbered expert moves
the logits by far more than the tolerance.
"""
from __future__ import annotations

import pytest
import torch

from tests.models import hf_factory, moe_bodies
from tests.multiproc import run_on_ranks
from tools.convert_hf.verify import prompts, transformers_logits
from verl_mcore.models.hf_config import UnsupportedConfigError, read_hf_arch, transformer_config

TOL = 1e-4
VOCAB = hf_factory.COMMON["vocab_size"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {f: hf_factory.save_tiny_model(f, str(root / f), seed=3)
            for f in hf_factory.MOE_FAMILIES}


@pytest.fixture(scope="module")
def tokens():
    return prompts(VOCAB, batch=2, seq_len=12)


def _max_rel(results, ref) -> float:
    outs = [r["out"] for r in results if r["out"] is not None]
    assert outs, "no rank returned logits"
    return max(((o[..., :VOCAB] - ref).abs().max() / ref.abs().max()).item() for o in outs)


def test_router_semantics_map_to_megatron_fields():
    a = {f: read_hf_arch(hf_factory.make_config(f).to_dict()) for f in hf_factory.MOE_FAMILIES}
    q2, q3, mx = a["qwen2_moe"].moe, a["qwen3_moe"].moe, a["mixtral"].moe
    assert q2.layers == (0, 2, 3) and q2.shared_expert_ffn_hidden_size == 48
    assert q3.layers == (0, 1, 2, 3) and q3.num_experts == 8 and a["qwen3_moe"].qk_norm
    assert mx.ffn_hidden_size == 96 and mx.norm_topk_prob
    c2 = transformer_config(a["qwen2_moe"], dtype="fp32")
    assert c2.moe_router_pre_softmax and c2.moe_shared_expert_gate
    assert c2.moe_layer_freq == [1, 0, 1, 1] and c2.moe_token_dispatcher_type == "alltoall"
    c3 = transformer_config(a["qwen3_moe"], dtype="fp32")
    assert not c3.moe_router_pre_softmax and c3.moe_layer_freq == 1
    assert c3.moe_shared_expert_intermediate_size is None and c3.moe_router_topk == 2
    assert c3.moe_aux_loss_coeff == 0.0  # output_router_logits false: HF trains without it
    on = read_hf_arch(hf_factory.make_config("qwen3_moe", output_router_logits=True,
                                             router_aux_loss_coef=0.01).to_dict())
    assert on.moe.aux_loss_coeff == pytest.approx(0.01 * 2 / 4)  # coef * k / MoE layers


@pytest.mark.parametrize("family,change,field", [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("mixtral", {"num_experts_per_tok": 1}, "num_experts_per_tok"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_unbuildable_moe_fields_are_named(family, change, field):
    cfg = hf_factory.make_config(family).to_dict()
    cfg.update(change)
    with pytest.raises(UnsupportedConfigError, match=f"`{field}`"):
        read_hf_arch(cfg)


@pytest.mark.parametrize("family", hf_factory.MOE_FAMILIES)
def test_one_rank_matches_transformers(moe_dirs, tokens, family):
    ref = transformers_logits(moe_dirs[family], tokens)
    results = run_on_ranks(moe_bodies.logits_body, 1,
                           args=(moe_dirs[family], 1, 1, 1, None, tokens), timeout=240)
    assert _max_rel(results, ref) <= TOL


@pytest.mark.parametrize("family", hf_factory.MOE_FAMILIES)
@pytest.mark.parametrize("tp,pp,ep,etp,world", [(1, 1, 2, None, 2), (2, 1, 2, 1, 2)],
                         ids=["ep2", "tp2_ep2_etp1"])
def test_expert_parallel_matches_transformers(moe_dirs, tokens, family, tp, pp, ep, etp, world):
    ref = transformers_logits(moe_dirs[family], tokens)
    results = run_on_ranks(moe_bodies.logits_body, world,
                           args=(moe_dirs[family], tp, pp, ep, etp, tokens), timeout=240)
    assert _max_rel(results, ref) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("family", hf_factory.MOE_FAMILIES)
@pytest.mark.parametrize("tp,pp,ep,etp", [(2, 1, 2, None), (1, 2, 2, None)],
                         ids=["tp2_ep2_etp2", "pp2_ep2"])
def test_four_rank_layouts_match_transformers(moe_dirs, tokens, family, tp, pp, ep, etp):
    ref = transformers_logits(moe_dirs[family], tokens)
    results = run_on_ranks(moe_bodies.logits_body, 4,
                           args=(moe_dirs[family], tp, pp, ep, etp, tokens), timeout=300)
    assert _max_rel(results, ref) <= TOL
