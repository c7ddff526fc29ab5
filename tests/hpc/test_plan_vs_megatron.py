"""The planner's parameter arithmetic against the megatron-core models our builder makes."""
import pytest

from tests.multiproc import run_on_ranks
from verl_mcore.config import Config
from verl_mcore.planning import memory as planner

# Shapes of tests/models/hf_factory.py (vocab 250 exercises padding; 2 KV groups over TP=2).
HF = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, vocab_size=250, max_position_embeddings=256, rms_norm_eps=1e-6,
          rope_theta=10000.0)
FAMILIES = {
    "llama": dict(HF, model_type="llama", tie_word_embeddings=False),
    "qwen2_tied": dict(HF, model_type="qwen2", tie_word_embeddings=True),
}


def _count_params(rank, world_size, hf: dict, tp: int, pp: int, targets):
    """Local parameter count of the actor and the critic on this rank at TP x PP, and with LoRA
    adapters on `targets` attached (models/lora.attach_lora): the model's, those that train on
    this rank, and those that count once in the whole model (TP-split tensors from every TP
    rank, replicated ones from TP rank 0)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.models.lora_bodies import lora_cfg
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import read_hf_arch, transformer_config
    from verl_mcore.models.lora import attach_lora

    cpu_compat.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(0)
    arch = read_hf_arch(hf)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    counts = {}
    for role in ("actor", "critic"):
        model = build_gpt_model(arch, transformer_config(arch, tp=tp, pp=pp, dtype=torch.float32),
                                role=role)
        counts[role] = sum(p.numel() for p in model.parameters())
        attach_lora(model, lora_cfg(_role_targets(targets, role)), arch, seed=0,
                    trainable=("output_layer",) if role == "critic" else ())
        trained = [p for p in model.parameters() if p.requires_grad]
        counts[f"{role} with lora"] = sum(p.numel() for p in model.parameters())
        counts[f"{role} trainable"] = sum(p.numel() for p in trained)
        counts[f"{role} whole"] = sum(p.numel() for p in trained
                                      if getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
    return {"stage": parallel_state.get_pipeline_model_parallel_rank(),
            "dp": parallel_state.get_data_parallel_rank(), **counts}


def _role_targets(targets, role):
    """The critic's output layer is its value head: lm_head is the actor's alone."""
    if role == "critic" and not isinstance(targets, str):
        return [t for t in targets if t != "lm_head"]
    return targets


@pytest.mark.distributed
@pytest.mark.parametrize("family, tp, pp, targets", [
    ("llama", 2, 2, ["v_proj", "lm_head"]),
    ("llama", 2, 2, ["k_proj", "o_proj", "gate_proj"]), ("qwen2_tied", 2, 2, ["q_proj", "v_proj"]),
    ("qwen2_tied", 1, 4, ["k_proj", "o_proj", "down_proj"]), ("qwen2_tied", 2, 1, "all-linear")])
def test_stage_params_match_megatron(family, tp, pp, targets):
    """role_params per rank; with LoRA (r=4) the planner's model, trainable and whole counts
    against attach_lora's adapters."""
    hf = FAMILIES[family]
    dims = planner.ModelDims.from_hf_config(hf)
    layout = [f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}"]
    cfg = Config.load(None, layout)
    def names(role):
        t = _role_targets(targets, role)
        return t if isinstance(t, str) else f"[{','.join(t)}]"

    lora = Config.load(None, layout + ["algorithm.adv_estimator=gae"] + [
        f"{role}.lora.{k}" for role in ("actor", "critic")
        for k in ("enable=true", "r=4", f"target_modules={names(role)}")])
    assert planner.lora_roles(lora) == ["actor", "critic"]
    results = run_on_ranks(_count_params, 4, args=(hf, tp, pp, targets), timeout=300)
    for r in results:
        for role in ("actor", "critic"):
            assert r[role] == planner.role_params(cfg, dims, role, r["stage"]), (family, role, r)
            assert r[f"{role} with lora"] == (planner.role_params(lora, dims, role, r["stage"])
                                              + planner.adapter_params(lora, dims, role, r["stage"])), r
            assert r[f"{role} trainable"] == planner.trainable_params(lora, dims, role, r["stage"]), r
    for role in ("actor", "critic"):
        whole = sum(r[f"{role} whole"] for r in results if r["dp"] == 0)
        # lm_head's B holds the padded vocabulary's rows; the planner counts peft's (the HF ones)
        padding = 0
        if role == "actor" and "lm_head" in targets:
            padding = 4 * (planner.padded_vocab(dims, tp, cfg.model.make_vocab_size_divisible_by)
                           - dims.vocab_size)
        assert whole == planner.lora_trainable_params(dims, getattr(lora, role).lora, role) + padding, role
