"""The planner's parameter arithmetic against the megatron-core models our builder makes."""
import pytest

from tests.multiproc import run_on_ranks
from verl_mcore import plan
from verl_mcore.config import Config

# Shapes of tests/models/hf_factory.py (vocab 250 exercises padding; 2 KV groups over TP=2).
HF = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, vocab_size=250, max_position_embeddings=256, rms_norm_eps=1e-6,
          rope_theta=10000.0)
FAMILIES = {
    "llama": dict(HF, model_type="llama", tie_word_embeddings=False),
    "qwen2_tied": dict(HF, model_type="qwen2", tie_word_embeddings=True),
}


def _count_params(rank, world_size, hf: dict, tp: int, pp: int):
    """Local parameter count of the actor and the critic on this rank at TP x PP."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from verl_mcore.distributed import cpu_compat
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import read_hf_arch, transformer_config

    cpu_compat.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(0)
    arch = read_hf_arch(hf)
    counts = {}
    for role in ("actor", "critic"):
        model = build_gpt_model(arch, transformer_config(arch, tp=tp, pp=pp, dtype=torch.float32),
                                role=role)
        counts[role] = sum(p.numel() for p in model.parameters())
    return {"stage": parallel_state.get_pipeline_model_parallel_rank(), **counts}


@pytest.mark.distributed
@pytest.mark.parametrize("family, tp, pp", [("llama", 2, 2), ("qwen2_tied", 2, 2),
                                            ("qwen2_tied", 1, 4), ("qwen2_tied", 2, 1)])
def test_stage_params_match_megatron(family, tp, pp):
    hf = FAMILIES[family]
    dims = plan.ModelDims.from_hf_config(hf)
    cfg = Config.load(None, [f"parallel.tensor_model_parallel_size={tp}",
                             f"parallel.pipeline_model_parallel_size={pp}"])
    results = run_on_ranks(_count_params, 4, args=(hf, tp, pp), timeout=300)
    for r in results:
        for role in ("actor", "critic"):
            assert r[role] == plan.role_params(cfg, dims, role, r["stage"]), (family, role, r)
