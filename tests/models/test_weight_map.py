"""The HF <-> megatron weight map as pure tensor functions."""
from __future__ import annotations

import pytest
import torch

from tests.models import hf_factory
from verl_mcore.models import weight_map as wm
from verl_mcore.models.hf_config import read_hf_arch


def _arch(family="llama2", **kw):
    return read_hf_arch(hf_factory.make_config(family, **kw).to_dict())


def test_fused_qkv_is_group_interleaved():
    # 4 query heads, 2 groups, head dim 1: rows tagged with their origin.
    q = torch.tensor([[10.], [11.], [12.], [13.]])
    k = torch.tensor([[20.], [21.]])
    v = torch.tensor([[30.], [31.]])
    fused = wm.fuse_qkv(q, k, v, num_groups=2)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    back = wm.split_qkv(fused, num_heads=4, num_groups=2, head_dim=1)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    bias = wm.fuse_qkv(q.flatten(), k.flatten(), v.flatten(), num_groups=2)  # 1-D biases too
    assert torch.equal(bias, fused.flatten())


def _random_hf(arch, pm, g):
    shapes = {"qkv": [(arch.num_heads * arch.head_dim, arch.hidden_size),
                      (arch.num_kv_heads * arch.head_dim, arch.hidden_size),
                      (arch.num_kv_heads * arch.head_dim, arch.hidden_size)]}
    if pm.kind == "qkv":
        return [torch.randn(s, generator=g) for s in shapes["qkv"]]
    if pm.kind == "gate_up":
        return [torch.randn(arch.ffn_hidden_size, arch.hidden_size, generator=g) for _ in range(2)]
    if pm.kind == "vocab":
        return [torch.randn(arch.vocab_size, arch.hidden_size, generator=g)]
    if pm.kind == "row":
        cols = arch.num_heads * arch.head_dim if "o_proj" in pm.hf[0] else arch.ffn_hidden_size
        return [torch.randn(arch.hidden_size, cols, generator=g)]
    return [torch.randn(arch.hidden_size, generator=g)]


@pytest.mark.parametrize("tp", [1, 2])
def test_slice_reads_equal_slicing_the_full_tensor(tp):
    """hf_read_slices + build_tp_local (what the on-the-fly loader does) == tp_slice(full), and
    tp_merge undoes tp_slice, for every kind of tensor."""
    arch = _arch("llama2")
    g = torch.Generator().manual_seed(0)
    padded = arch.padded_vocab_size(tp)
    for pm in wm.param_maps(arch, "actor", layers=[0]):
        hf = dict(zip(pm.hf, _random_hf(arch, pm, g)))
        full = wm.hf_to_mcore(pm, arch, [hf[n] for n in pm.hf], padded)
        shards = []
        for rank in range(tp):
            parts = []
            for name, dim, start, stop in wm.hf_read_slices(pm, arch, rank, tp, padded):
                t = hf[name]
                parts.append(t.narrow(dim, start, (t.shape[dim] if stop == -1 else stop) - start))
            local = wm.build_tp_local(pm, arch, parts, tp, padded)
            assert torch.equal(local, wm.tp_slice(pm, full, rank, tp)), (pm.mcore, rank)
            shards.append(local)
        assert torch.equal(wm.tp_merge(pm, shards), full), pm.mcore
        back = wm.mcore_to_hf(pm, arch, full)
        assert all(torch.equal(back[n], hf[n]) for n in pm.hf), pm.mcore


def test_gate_up_slices_take_a_block_of_each_half():
    pm = wm.ParamMap("x", ("g", "u"), "gate_up")
    full = torch.arange(8.).unsqueeze(1)  # gate rows 0..3, up rows 4..7
    assert wm.tp_slice(pm, full, 1, 2).flatten().tolist() == [2, 3, 6, 7]


def test_vocab_padding_rows_are_zero_and_dropped_on_export():
    arch = _arch("llama2")
    pm = wm.param_maps(arch)[0]
    emb = torch.randn(arch.vocab_size, arch.hidden_size)
    full = wm.hf_to_mcore(pm, arch, [emb])
    assert full.shape[0] == 256 and torch.all(full[250:] == 0)
    assert torch.equal(wm.mcore_to_hf(pm, arch, full)["model.embed_tokens.weight"], emb)


@pytest.mark.parametrize("family", hf_factory.FAMILIES)
def test_maps_cover_exactly_the_hf_state_dict(family):
    import transformers

    config = hf_factory.make_config(family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    hf_names = set(model.state_dict())
    if config.tie_word_embeddings:
        hf_names.discard("lm_head.weight")
    mapped = {n for pm in wm.param_maps(read_hf_arch(config.to_dict())) for n in pm.hf}
    assert mapped == hf_names


def test_roles_pick_the_head():
    tied, untied = _arch("qwen2"), _arch("qwen2_untied")
    assert wm.head_param_map(tied, "actor") is None  # tied: the embedding is the head
    assert wm.head_param_map(untied, "reference").hf == ("lm_head.weight",)
    assert wm.head_param_map(untied, "reward").hf == ("score.weight",)
    assert wm.head_param_map(untied, "critic") is None  # fresh value head
    with pytest.raises(ValueError, match="unknown model role"):
        wm.head_param_map(untied, "policy")


def test_canonical_names_use_global_layers_and_te_spelling():
    assert wm.canonical_name("decoder.layers.1.input_layernorm.weight", 5) == \
        "decoder.layers.5.self_attention.linear_qkv.layer_norm_weight"
    assert wm.canonical_name("decoder.layers.0.pre_mlp_layernorm.weight") == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert wm.canonical_name("output_layer.weight") == "output_layer.weight"


@pytest.mark.parametrize("layers,pp,first,last", [
    (8, 2, None, None), (8, 4, None, None), (10, 4, 1, 3), (10, 3, 2, None), (7, 3, None, 1),
])
def test_stage_layers_match_megatron(layers, pp, first, last):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=1,
                               pipeline_model_parallel_size=pp,
                               num_layers_in_first_pipeline_stage=first,
                               num_layers_in_last_pipeline_stage=last,
                               pipeline_dtype=torch.float32)
    covered = []
    for rank in range(pp):
        ours = wm.stage_layers(layers, pp, rank, first, last)
        offset = get_transformer_layer_offset(config, pp_rank=rank)
        count = get_num_layers_to_build(config, pp_rank=rank)
        assert ours == range(offset, offset + count), rank
        covered += list(ours)
    assert covered == list(range(layers))


def test_hf_tensors_from_mcore_skips_heads_without_hf_names():
    arch = _arch("qwen2")  # tied embeddings
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(256, arch.hidden_size, generator=g)
    head = torch.randn(1, arch.hidden_size, generator=g)
    out = dict(wm.hf_tensors_from_mcore(arch, [("embedding.word_embeddings.weight", emb),
                                               ("output_layer.weight", head)], role="critic"))
    assert list(out) == ["model.embed_tokens.weight"]
    assert torch.equal(out["model.embed_tokens.weight"], emb[:250])
