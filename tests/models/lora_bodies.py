"""Rank bodies for the LoRA tests (module level: spawn pickles them by name)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.models.parity_bodies import setup_megatron


def lora_cfg(targets, r=4, alpha=8.0, init=False):
    return SimpleNamespace(enable=True, r=r, alpha=alpha, dropout=0.0, target_modules=targets,
                           init_lora_weights=init, lr=None, init_from=None)


def adapter_shards(model) -> list[tuple]:
    """(peft key, TP rank, TP shard dim or None, tensor) of every adapter tensor of a rank's
    model chunks: what assemble_adapters joins into full tensors."""
    from verl_mcore.models import lora as L

    return [(L.peft_key(a.layer, t, w), a.tp_rank, L.tp_shard_dim(t, w),
             (a.lora_A if w == "A" else a.lora_B)[t].detach().clone())
            for a in L.adapters_of(model) for t in a.targets for w in ("A", "B")]


def assemble_adapters(results, key: str) -> dict[str, torch.Tensor]:
    """{peft key: full tensor} from the ranks' results: `result[key]` lists (peft key, TP rank,
    TP shard dim or None, tensor) as adapter_shards gives them; DP rank 0's shards are joined."""
    parts: dict[str, dict[int, tuple]] = {}
    for res in results:
        if res["dp_rank"] == 0:
            for name, tp_rank, dim, t in res[key]:
                parts.setdefault(name, {})[tp_rank] = (dim, t)
    out = {}
    for name, shards in parts.items():
        dim = shards[0][0]
        out[name] = shards[0][1] if dim is None else torch.cat(
            [shards[r][1] for r in sorted(shards)], dim=dim)
    return out


def lora_logits_body(rank, world_size, hf_dir, tp, pp, targets, tokens, seed, sequence_parallel):
    """Logits of the model at TP x PP with random non-zero adapters (seeded), and with them off."""
    from megatron.core import parallel_state

    from verl_mcore.convert_hf.verify import megatron_logits
    from verl_mcore.models.load import build_and_load
    from verl_mcore.models.lora import adapters_disabled, attach_lora

    setup_megatron(tp, pp)
    extra = {"sequence_parallel": True} if sequence_parallel and tp > 1 else {}
    model, arch = build_and_load("actor", hf_path=hf_dir, dtype="fp32", tp=tp, pp=pp, **extra)
    adapters = attach_lora(model, lora_cfg(targets), arch, seed=seed)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    with_lora = megatron_logits(model, tokens)
    with adapters_disabled([model]):
        base = megatron_logits(model, tokens)
    last_tp0 = parallel_state.get_tensor_model_parallel_rank() == 0 and with_lora is not None
    return {"lora": with_lora if last_tp0 else None, "base": base if last_tp0 else None,
            "trainable": trainable, "n_adapters": len(adapters)}


def lora_checkpoint_body(rank, world_size, hf_dir, tp, pp, targets, tokens, seed, root):
    """A LoRA actor at TP x PP with random non-zero adapters (`targets` None: no LoRA, a fully
    trained model), saved as the trainer saves it (engine.checkpoint.Checkpointer: with LoRA the
    adapters only, meta.json recording the base; the run's config.yaml and model_arch.json);
    returns its logits (last stage, TP rank 0; else None) and the step directory."""
    from megatron.core import parallel_state

    from verl_mcore.config.resume import checkpoint_files
    from verl_mcore.config.schema import Config, LoRAConfig
    from verl_mcore.convert_hf.verify import megatron_logits
    from verl_mcore.engine.checkpoint import Checkpointer
    from verl_mcore.models.load import build_and_load
    from verl_mcore.models.lora import attach_lora

    setup_megatron(tp, pp)
    model, arch = build_and_load("actor", hf_path=hf_dir, dtype="fp32", tp=tp, pp=pp)
    cfg = Config()
    cfg.model.path = hf_dir
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    if targets is not None:
        lora = lora_cfg(targets)
        attach_lora(model, lora, arch, seed=seed)
        cfg.actor.lora = LoRAConfig(enable=True, r=lora.r, alpha=lora.alpha,
                                    dropout=lora.dropout, target_modules=targets,
                                    init_lora_weights=lora.init_lora_weights)
    path = Checkpointer(root, base_weights=hf_dir).save(1, [model],
                                                         extra_files=checkpoint_files(cfg, arch))
    logits = megatron_logits(model, tokens)
    keep = parallel_state.get_tensor_model_parallel_rank() == 0 and logits is not None
    return {"logits": logits if keep else None, "path": path}


def lora_from_peft_body(rank, world_size, hf_dir, tp, pp, targets, tokens, peft_dir):
    """A fresh LoRA actor at TP x PP started from a peft adapter directory as lora.init_from
    starts it (attach_lora with peft's zero-B init, then load_peft_dir): its logits (last stage,
    TP rank 0; else None) and this rank's adapter shards {(layer, target, "A"/"B"): tensor}."""
    from megatron.core import parallel_state

    from verl_mcore.convert_hf.verify import megatron_logits
    from verl_mcore.models.load import build_and_load
    from verl_mcore.models.lora import attach_lora, load_peft_dir

    setup_megatron(tp, pp)
    lora = lora_cfg(targets, init=True)
    model, arch = build_and_load("actor", hf_path=hf_dir, dtype="fp32", tp=tp, pp=pp)
    adapters = attach_lora(model, lora, arch, seed=0)
    load_peft_dir(adapters, peft_dir, lora)
    logits = megatron_logits(model, tokens)
    keep = parallel_state.get_tensor_model_parallel_rank() == 0 and logits is not None
    shards = {(a.layer, t, w): getattr(a, f"lora_{w}")[t].detach().clone()
              for a in adapters for t in a.targets for w in ("A", "B")}
    return {"logits": logits if keep else None, "shards": shards,
            "tp_rank": parallel_state.get_tensor_model_parallel_rank()}


def lora_resume_body(rank, world_size, hf_dir, targets, step_dir, seed):
    """Load a LoRA checkpoint's adapters onto the base in `hf_dir` (the model.path of a resume),
    as the trainer does; returns None, or the refusal's message."""
    from verl_mcore.engine.checkpoint import Checkpointer
    from verl_mcore.models.load import build_and_load
    from verl_mcore.models.lora import attach_lora

    setup_megatron(1, 1)
    model, arch = build_and_load("actor", hf_path=hf_dir, dtype="fp32", tp=1, pp=1)
    attach_lora(model, lora_cfg(targets), arch, seed=seed)
    try:
        Checkpointer(str(step_dir) + ".root", base_weights=hf_dir).load([model], path=step_dir)
    except ValueError as e:
        return str(e)
    return None
