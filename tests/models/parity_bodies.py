"""Rank bodies for the megatron-vs-transformers tests (module level: spawn pickles them by name)."""
from __future__ import annotations

import torch


def setup_megatron(tp: int, pp: int, seed: int = 0) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from verl_mcore.distributed import cpu_compat

    cpu_compat.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)


def logits_body(rank: int, world_size: int, hf_dir: str, source: str, tp: int, pp: int,
                role: str, tokens: torch.Tensor, ckpt_dir: str | None = None,
                core_attention: str = "sdpa", config_overrides: dict | None = None):
    """Build `role` at TP x PP from `source`: "hf" (weights from the HF dir), "ckpt" (dist
    checkpoint, config from the HF dir) or "ckpt_only" (dist checkpoint alone).

    Returns {"out": gathered outputs on the last stage's TP rank 0 (None elsewhere),
    "read_bytes": bytes this rank read from the HF files, "head": a scalar head's weight}.
    """
    from megatron.core import parallel_state

    from tools.convert_hf.verify import megatron_logits
    from verl_mcore.models.hf_weights import HFCheckpoint
    from verl_mcore.models.load import build_and_load

    setup_megatron(tp, pp)
    # Count what this rank reads from the HF files: only its own slice should be read.
    read_bytes = 0
    original = HFCheckpoint.read

    def counting_read(self, *args, **kwargs):
        nonlocal read_bytes
        t = original(self, *args, **kwargs)
        read_bytes += t.numel() * t.element_size()
        return t

    HFCheckpoint.read = counting_read
    try:
        # "ckpt_only": the architecture too comes from the checkpoint's stored config.json.
        model, _ = build_and_load(role, hf_path=None if source == "ckpt_only" else hf_dir,
                                  checkpoint=None if source == "hf" else ckpt_dir,
                                  dtype="fp32", tp=tp, pp=pp, core_attention=core_attention,
                                  **(config_overrides or {}))
    finally:
        HFCheckpoint.read = original
    head = None
    if role in ("critic", "reward") and parallel_state.is_pipeline_last_stage():
        head = model.output_layer.weight.detach().clone()
    out = megatron_logits(model, tokens)
    return {"out": out if parallel_state.get_tensor_model_parallel_rank() == 0 else None,
            "read_bytes": read_bytes, "head": head}


def packed_body(rank: int, world_size: int, hf_dir: str, lengths: list[int]):
    """Logits of sequences of `lengths` packed into one THD row vs each run alone (TP=1)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import read_hf_arch, transformer_config
    from verl_mcore.models.hf_weights import load_hf_weights

    setup_megatron(1, 1)
    arch = read_hf_arch(hf_dir)
    model = build_gpt_model(arch, transformer_config(arch, dtype="fp32"))
    load_hf_weights(model, arch, hf_dir)
    model.eval()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, arch.vocab_size, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    tokens = torch.cat(seqs).unsqueeze(0)  # [1, total]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    from verl_mcore.models import rope

    assert attention.apply_rotary_pos_emb is rope.apply_rotary_pos_emb, "installed by the builder"
    with torch.no_grad():
        packed = model(tokens, positions, None, packed_seq_params=params)[0]  # [total, V]
        alone = torch.cat([model(s.unsqueeze(0), torch.arange(len(s)).unsqueeze(0), None)[0]
                           for s in seqs])
        attention.apply_rotary_pos_emb = rope_utils.apply_rotary_pos_emb  # megatron's own
        try:
            megatron_rope = model(tokens, positions, None, packed_seq_params=params)[0]
        finally:
            attention.apply_rotary_pos_emb = rope.apply_rotary_pos_emb
    return {"packed": packed, "alone": alone, "megatron_rope": megatron_rope}


def save_body(rank: int, world_size: int, hf_dir: str, tp: int, pp: int, ckpt_dir: str):
    """Build at TP x PP from the HF dir and save with megatron's own dist_checkpointing.save."""
    import os

    from megatron.core import dist_checkpointing

    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import read_hf_arch, transformer_config
    from verl_mcore.models.hf_weights import load_hf_weights

    setup_megatron(tp, pp)
    arch = read_hf_arch(hf_dir)
    model = build_gpt_model(arch, transformer_config(arch, tp=tp, pp=pp, dtype="fp32"))
    load_hf_weights(model, arch, hf_dir)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    return None


def critic_resume_body(rank: int, world_size: int, hf_dir: str, ckpt_dir: str):
    """Save a critic (fresh head) with dist_checkpointing, resume it into a new critic: the head
    must come back (not be re-initialised). Returns (restored, differs_from_a_fresh_head)."""
    import os

    from megatron.core import dist_checkpointing

    from verl_mcore.models.checkpoint import load_dist_checkpoint
    from verl_mcore.models.load import build_and_load

    setup_megatron(1, 1)
    saved, _ = build_and_load("critic", hf_path=hf_dir, dtype="fp32")
    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save(saved.sharded_state_dict(), ckpt_dir)
    torch.manual_seed(123)  # a different fresh head than the saved one
    resumed, _ = build_and_load("critic", hf_path=hf_dir, dtype="fp32")
    fresh = resumed.output_layer.weight.detach().clone()
    load_dist_checkpoint(resumed, ckpt_dir, role="critic")
    head = saved.output_layer.weight
    return (torch.equal(resumed.output_layer.weight, head), not torch.equal(fresh, head))
