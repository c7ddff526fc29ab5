"""Build megatron-core GPTModels for the four roles from an `HFArch`.

    arch = read_hf_arch(hf_dir)
    config = transformer_config(arch, tp=2, pp=2, dtype="bf16")
    model = build_gpt_model(arch, config, role="actor")        # this rank's TP/PP slice
    load_hf_weights(model, arch, hf_dir, role="actor")          # hf_weights.py

Roles: actor / reference get the LM head (tied to the embedding when config.json says so);
critic / reward get a `ScalarHead` in place of the output layer: the model then returns
[b, s, 1] values instead of [b, s, vocab] logits. A critic's head starts fresh (HF has none);
a reward model's head is the `score` weight of an HF *ForSequenceClassification checkpoint.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from verl_mcore.models.attention import SDPAttention
from verl_mcore.models.hf_config import DEFAULT_VOCAB_DIVISIBLE_BY, HFArch
from verl_mcore.models.rope import install_packed_rope, install_rope
from verl_mcore.models.weight_map import ROLES
from verl_mcore.utils.device import compute_device, cuda_in_use


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The bare GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    return module


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401  (optional: fused layers where installed)
    except ImportError:
        return False
    return True


def gpt_layer_spec(arch: HFArch, use_te: Optional[bool] = None, core_attention: str = "sdpa",
                   num_experts: Optional[int] = None):
    """Decoder layer spec: megatron's TransformerEngine spec when CUDA and TE are there (or
    `use_te=True`), else megatron's local spec with `core_attention` "sdpa" (ours) or "local"
    (megatron's DotProductAttention, which materialises the [s, s] scores).

    `num_experts`: a MoE layer (router, SequentialMLP experts: one MLP module per local expert,
    and Qwen2-MoE's shared expert when the config has one); None: a dense SwiGLU MLP. Grouped
    expert GEMMs (megatron's GroupedMLP) need the `grouped_gemm` package or TransformerEngine's
    TEGroupedMLP, and store the experts under other parameter names: not used yet."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te is None:
        use_te = cuda_in_use() and have_transformer_engine()
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                    qk_layernorm=arch.qk_norm,
                                                    normalization="RMSNorm")
    if core_attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    elif core_attention != "local":
        raise ValueError(f"gpt_layer_spec: core_attention must be 'sdpa' or 'local', "
                         f"got {core_attention!r}")
    return spec


def moe_block_spec(arch: HFArch, config, use_te: Optional[bool], core_attention: str,
                   pp_rank: int, vp_stage: Optional[int] = None):
    """The decoder block of a MoE architecture for one pipeline stage: a MoE layer spec where
    `arch.moe` routes, a dense one elsewhere (Qwen's mlp_only_layers / decoder_sparse_step),
    sliced to this stage's layers as megatron's get_gpt_decoder_block_spec slices them."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    allow_moe_without_transformer_engine()
    dense = gpt_layer_spec(arch, use_te, core_attention)
    moe = gpt_layer_spec(arch, use_te, core_attention, num_experts=arch.moe.num_experts)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = transformer_block.get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    specs = [moe if arch.moe.is_moe_layer(i) else dense for i in range(offset, offset + count)]
    # The final norm the dense path gets from megatron for a single layer spec.
    return TransformerBlockSubmodules(layer_specs=specs,
                                      layer_norm=transformer_block.LayerNormImpl)


def allow_moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router linear (moe_utils.RouterGatingLinearFunction) tests
    `te_general_gemm is not None`, but moe_utils binds that name only when TransformerEngine
    imports: without TE every MoE forward raises NameError (on GPU too). Binding it to None
    selects the torch.mm path that the function has for that case. A no-op with TE."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class ScalarHead(torch.nn.Module):
    """Value / reward head in the output layer's place: [s, b, H] -> [s, b, n_out], float32.

    It computes in float32 whatever the model's dtype (a bf16 critic's weight, whose master copy
    in the optimizer is fp32, is upcast with its input, as megatron computes its MoE router in
    `moe_router_dtype`): values are regression targets, and bf16 outputs would round every value
    to 8 bits of mantissa before the value loss sees it.

    The weight [n_out, H] is replicated over TP (every rank computes the same values). With
    sequence parallelism the input arrives split along s and is gathered first; the gather's
    backward only splits the gradient (each rank already holds the full-sequence gradient), and
    the weight's gradient is the same on every TP rank, so it needs no TP all-reduce.
    """

    def __init__(self, config, out_features: int = 1):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        weight = torch.empty(out_features, config.hidden_size, dtype=config.params_dtype)
        if config.perform_initialization:
            torch.nn.init.normal_(weight, mean=0.0, std=config.init_method_std)
        else:
            weight.zero_()
        self.weight = torch.nn.Parameter(weight.to(compute_device()))

    def forward(self, hidden_states: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        # (output, bias) like a megatron linear
        return F.linear(hidden_states.float(), self.weight.float()), None


def _stage_flags(pg_collection, pre_process, post_process) -> tuple[bool, bool]:
    if pre_process is not None and post_process is not None:
        return pre_process, post_process
    if pg_collection is not None:
        from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage

        first, last = is_pp_first_stage(pg_collection.pp), is_pp_last_stage(pg_collection.pp)
    else:
        from megatron.core import parallel_state

        first = parallel_state.is_pipeline_first_stage()
        last = parallel_state.is_pipeline_last_stage()
    return (first if pre_process is None else pre_process,
            last if post_process is None else post_process)


def build_gpt_model(arch: HFArch, config, *, role: str = "actor",
                    pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                    pg_collection=None, use_te: Optional[bool] = None,
                    core_attention: str = "sdpa",
                    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
                    padded_vocab: Optional[int] = None,
                    vp_stage: Optional[int] = None):
    """This rank's GPTModel for `role` (weights initialised randomly; load them afterwards).

    `config` comes from `transformer_config(arch, ...)`; `pg_collection` (megatron
    ProcessGroupCollection) selects non-default TP/PP groups, otherwise megatron's parallel_state
    is used. The vocabulary is padded to `padded_vocab` rows when given (a generation model takes
    its training model's, whose TP differs), else to `arch.padded_vocab_size(tp,
    vocab_divisible_by)`; `model.vocab_size` is the padded size and logits beyond
    `arch.vocab_size` are padding.
    """
    from megatron.core.models.gpt import GPTModel

    if role not in ROLES:
        raise ValueError(f"build_gpt_model: unknown role {role!r}; expected one of {list(ROLES)}")
    tp = config.tensor_model_parallel_size
    if padded_vocab is None:
        padded_vocab = arch.padded_vocab_size(tp, vocab_divisible_by)
    elif padded_vocab < arch.vocab_size or padded_vocab % tp:
        raise ValueError(f"build_gpt_model: padded_vocab={padded_vocab} must be at least the "
                         f"vocabulary ({arch.vocab_size}) and divisible by TP={tp}")
    # Packed (THD) RoPE without megatron's per-layer host syncs (models/rope.py); process-wide,
    # bit for bit the same values, and a no-op after the first model.
    install_packed_rope()
    pre, post = _stage_flags(pg_collection, pre_process, post_process)
    lm_head = role in ("actor", "reference")
    kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    if arch.moe is None:
        spec = gpt_layer_spec(arch, use_te, core_attention)
    else:
        pp_group = pg_collection.pp if pg_collection is not None else None
        if pp_group is None:
            from megatron.core import parallel_state

            pp_group = parallel_state.get_pipeline_model_parallel_group()
        spec = moe_block_spec(arch, config, use_te, core_attention, pp_group.rank(), vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_embeddings and lm_head,
        position_embedding_type="rope",
        rotary_base=arch.rope.theta,
        vp_stage=vp_stage,
        **kwargs,
    )
    if cuda_in_use():
        # Megatron's parallel linears allocate on the GPU, but the torch-norm fallback (no
        # apex / TE) and our head are built on the CPU: megatron's trainers call .cuda() too.
        model.cuda(torch.cuda.current_device())
    install_rope(model, arch.rope, arch.head_dim)
    if post and not lm_head:
        out = arch.num_labels if role == "reward" and arch.num_labels else 1
        model.output_layer = ScalarHead(config, out)
        tp_group = model.pg_collection.tp
        if tp_group.size() > 1:
            # The replicated head must start equal on every TP rank, whatever each rank's
            # CPU generator state was.
            torch.distributed.broadcast(model.output_layer.weight.data,
                                        src=torch.distributed.get_global_rank(tp_group, 0),
                                        group=tp_group)
    return model
