"""The planner counts a mixture-of-experts model's parameters per rank as megatron-core builds
them at EP 1 and 2 (router, the rank's experts, the shared expert), reads the MoE fields as
models/hf_config does, and shards the experts' optimizer state over DP / EP."""
import pytest

from tests.models import hf_factory
from tests.multiproc import run_on_ranks
from verl_mcore.config import Config
from verl_mcore.planning import memory as planner


def _hf(family: str) -> dict:
    return hf_factory.make_config(family).to_dict()


def _count_params(rank, world_size, family: str, ep: int):
    from megatron.core import parallel_state

    from tests.models.moe_bodies import setup_megatron
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import read_hf_arch, transformer_config

    setup_megatron(1, 1, ep)
    arch = read_hf_arch(_hf(family))
    config = transformer_config(arch, dtype="fp32", expert_model_parallel_size=ep)
    model = build_gpt_model(arch, config, role="actor")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".local_experts." in n)
    return {"all": sum(p.numel() for p in model.parameters()), "experts": experts,
            "dp": parallel_state.get_data_parallel_rank()}


@pytest.mark.parametrize("family", hf_factory.MOE_FAMILIES)
def test_moe_fields_read_as_the_model_builder_reads_them(family):
    from verl_mcore.models.hf_config import read_hf_arch

    hf = _hf(family)
    dims, moe = planner.ModelDims.from_hf_config(hf), read_hf_arch(hf).moe
    assert (dims.num_experts, dims.moe_topk, dims.moe_ffn_hidden_size, dims.moe_layers,
            dims.shared_expert_ffn_hidden_size) == (
        moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.layers,
        moe.shared_expert_ffn_hidden_size or 0)
    assert dims.shape().num_experts == moe.num_experts


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("ep", [1, 2])
def test_parameters_per_rank_equal_megatrons(family, ep):
    hf = _hf(family)
    dims = planner.ModelDims.from_hf_config(hf)
    cfg = Config.load(None, [f"parallel.expert_model_parallel_size={ep}",
                             "model.make_vocab_size_divisible_by=128"])
    results = run_on_ranks(_count_params, ep, args=(family, ep), timeout=240)
    for res in results:
        assert planner.role_params(cfg, dims, "actor", 0) == res["all"]
        assert sum(planner.expert_params(dims, 1, layer, ep)
                   for layer in range(dims.num_layers)) == res["experts"]


def test_expert_optimizer_state_is_sharded_over_dp_over_ep():
    dims = planner.ModelDims.from_hf_config(_hf("qwen3_moe"))
    knobs = planner.Knobs()
    experts = sum(planner.expert_params(dims, 1, layer, 2) for layer in range(dims.num_layers))

    def optimizer(ep):
        cfg = Config.load(None, [f"parallel.expert_model_parallel_size={ep}", "actor.dtype=bf16",
                                 "actor.micro_batch_size_per_gpu=1"])
        return planner.training_bytes(cfg, dims, 4, "actor", 0, knobs)["optimizer"]

    # DP 4: at EP 1 every parameter's state / 4; at EP 2 each rank holds half the experts and
    # their state is split over DP / EP = 2 ranks: the experts' share per rank is unchanged,
    # the rest the same, so the total is equal; parameters drop by the other half's experts.
    assert optimizer(2) == pytest.approx(optimizer(1), abs=24)
    cfg1 = Config.load(None, ["parallel.expert_model_parallel_size=1"])
    cfg2 = Config.load(None, ["parallel.expert_model_parallel_size=2"])
    assert planner.role_params(cfg1, dims, "actor", 0) - planner.role_params(cfg2, dims, "actor", 0) \
        == experts
