"""Repartition from training (TP_t × PP) to generation (TP_g) layouts, against the unsharded model."""
import pytest
import torch

from tests.multiproc import run_on_ranks


def _semantic_slice(full: torch.Tensor, name: str, rank: int, size: int) -> torch.Tensor:
    """This TP rank's part of a full tensor under megatron's TP semantics, written out by name
    (SwiGLU fc1 = [gate; up] per shard; column-parallel rows; row-parallel columns)."""
    if size == 1:
        return full
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(size, dim=1)[rank]
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight",
                      "linear_qkv.bias")):
        return full.chunk(size, dim=0)[rank]
    return full


def _body(rank, world_size, tp, pp, tp_gen, query_groups):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.distributed import tiny_gpt
    from verl_mcore.config import Config
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups
    from verl_mcore.rollout.repartition import Repartitioner, global_param_names

    cpu_compat.install()
    overrides = {"num_query_groups": query_groups}
    # The unsharded model (the oracle), built identically on every rank.
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    full = {n: p.detach().clone() for n, p in
            tiny_gpt.build_model(tiny_gpt.make_config(**overrides)).named_parameters()}
    parallel_state.destroy_model_parallel()

    cfg = Config.load(None, [f"parallel.tensor_model_parallel_size={tp}",
                             f"parallel.pipeline_model_parallel_size={pp}",
                             f"rollout.tensor_parallel_size={tp_gen}"])
    groups = build_groups(cfg)
    train = tiny_gpt.build_model(tiny_gpt.make_config(tp, pp, **overrides))
    with torch.no_grad():
        for name, p in global_param_names(train).items():
            p.copy_(_semantic_slice(full[name], name, groups.tp_rank, tp))

    gen_cfg = tiny_gpt.make_config(tp_gen, 1, perform_initialization=False, **overrides)
    gen = GPTModel(config=gen_cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                   vocab_size=tiny_gpt.VOCAB, max_sequence_length=tiny_gpt.SEQ, pre_process=True,
                   post_process=True, position_embedding_type="rope", pg_collection=groups.gen)
    rep = Repartitioner([train], gen, groups, gated_linear_unit=True)
    stats = rep.run()

    mismatched = []
    for name, p in global_param_names(gen).items():
        expected = _semantic_slice(full[name], name, groups.gen_tp_rank, tp_gen)
        if not torch.equal(p.detach(), expected):
            mismatched.append(name)
    names = set(global_param_names(gen))
    # A second step reuses the same buffer and sees new training weights.
    ptr = rep.buffer.buffer.data_ptr()
    with torch.no_grad():
        for p in train.parameters():
            p.add_(1.0)
    rep.run()
    second_ok = all(torch.equal(p.detach(), _semantic_slice(full[n] + 1.0, n, groups.gen_tp_rank, tp_gen))
                    for n, p in global_param_names(gen).items())
    largest_shard = max(p.numel() * p.element_size() for p in train.parameters())
    return {"mismatched": mismatched, "names": names, "full_names": set(full), "stats": stats,
            "second_ok": second_ok, "same_buffer": rep.buffer.buffer.data_ptr() == ptr,
            "gen_bytes": sum(p.numel() * p.element_size() for p in gen.parameters()),
            "train_bytes": sum(p.numel() * p.element_size() for p in train.parameters()),
            "largest_shard": largest_shard, "k": tp // tp_gen}


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp, tp_gen, world, query_groups", [
    (2, 2, 1, 4, 2),
    (2, 1, 2, 2, 2),
    (2, 2, 2, 4, 2),
    (4, 1, 2, 4, 4),
])
def test_repartition_matches_unsharded_slices(tp, pp, tp_gen, world, query_groups):
    results = run_on_ranks(_body, world, args=(tp, pp, tp_gen, query_groups), timeout=240)
    for rank, r in enumerate(results):
        assert r["mismatched"] == [], f"rank {rank}: {r['mismatched']}"
        assert r["names"] == r["full_names"]
        assert r["second_ok"] and r["same_buffer"]
        s = r["stats"]
        # The buffer is exactly this rank's TP_g shard; the only other memory is one tensor in flight.
        assert s.generation_bytes == r["gen_bytes"]
        assert s.peak_temp_bytes <= 2 * r["k"] * r["largest_shard"] + r["largest_shard"]
        # Received bytes equal the lower bound: what the rank lacked of its TP_g shard.
        assert s.bytes_received == s.min_bytes_received
        if tp == tp_gen and pp == 1:
            assert s.bytes_received == 0
        else:
            assert s.bytes_received > 0


def test_different_padded_vocabularies_are_refused_before_any_weight_moves():
    """A generation model padded otherwise than the training model (e.g. by Megatron's
    divisible × TP rule) is refused when the Repartitioner is built: no groups are touched."""
    from verl_mcore.rollout.repartition import Repartitioner

    class Model(torch.nn.Module):
        def __init__(self, vocab_size):
            super().__init__()
            self.decoder, self.vocab_size = torch.nn.Module(), vocab_size

    with pytest.raises(ValueError, match="generation model pads the vocabulary to 256 rows, the "
                                         "training model to 128; they must be equal"):
        Repartitioner([Model(128), Model(128)], Model(256), groups=None, gated_linear_unit=True)
