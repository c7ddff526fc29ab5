"""Compare a megatron model (from a dist checkpoint, at a TP x PP layout) with transformers.

`verify` runs on tp * pp ranks: under torchrun / srun it uses the launched ranks; otherwise it
spawns them itself on this machine (gloo on CPU, NCCL on GPUs). Every rank builds its stage of the
model, loads its slice of the checkpoint and runs the same prompts; the last pipeline stage
gathers the vocabulary-parallel logits, and rank 0 of the job compares them with the logits of
`transformers.AutoModelForCausalLM` on the HF directory (in fp32).
"""
from __future__ import annotations

import os
import socket
from typing import Optional

import torch
import torch.multiprocessing as mp

from verl_mcore.distributed import cpu_compat
from verl_mcore.models.gpt import ScalarHead
from verl_mcore.models.hf_config import read_hf_arch
from verl_mcore.models.load import build_and_load

DEFAULT_TOLERANCE = 1e-4  # max |diff| / max |hf logit|, fp32


def prompts(vocab_size: int, batch: int = 2, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    """Random token prompts [batch, seq_len] (ids below the true, unpadded vocabulary)."""
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def megatron_logits(model, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """Full-vocabulary outputs [b, s, V_padded] (or [b, s, n] for a scalar head) of a GPTModel
    stage run through megatron's pipeline schedule; None on ranks that are not the last stage.

    One micro-batch holds the whole batch. Vocabulary-parallel logits are gathered over TP.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    device = next(model.parameters()).device
    tokens = tokens.to(device)
    b, s = tokens.shape
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)

    def forward_step(data_iterator, model_):
        batch = next(data_iterator)
        out = model_(batch, position_ids, None)  # causal attention (no explicit mask)

        def collect(output):
            return output.new_zeros(()), {"logits": output.detach()}

        return out, collect

    model.eval()
    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model],
            num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    logits = results[0]["logits"]
    if not isinstance(model.output_layer, ScalarHead):  # LM head: vocabulary-parallel logits
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits.float().cpu()


def transformers_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 outputs for `tokens` [b, s]: logits [b, s, V] of a causal LM, or the
    `score` head at every position [b, s, n] of a *ForSequenceClassification model."""
    import transformers

    seq_cls = read_hf_arch(hf_dir, max_seq_len=tokens.shape[1]).num_labels is not None
    cls = (transformers.AutoModelForSequenceClassification if seq_cls
           else transformers.AutoModelForCausalLM)
    model = cls.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        if seq_cls:
            return model.score(model.model(input_ids=tokens).last_hidden_state)
        return model(input_ids=tokens).logits


def _rank_main(rank: int, world_size: int, port: int, hf_dir: str, ckpt_dir: str, tp: int,
               pp: int, tokens: torch.Tensor, results, ep: int = 1) -> None:
    """One spawned rank of `verify` (also the body when launched by torchrun: results None)."""
    import torch.distributed as dist

    if results is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        backend = "nccl"
    else:
        cpu_compat.install()
        backend = "gloo"
        if results is not None:
            # Spawned ranks share this machine's cores: oversubscribed OpenMP threads spinning
            # next to gloo's busy waits slow a CPU run down by an order of magnitude.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0)
    seq_len = tokens.shape[1]
    arch = read_hf_arch(hf_dir, max_seq_len=seq_len)
    role = "reward" if arch.num_labels is not None else "actor"
    model, _ = build_and_load(role, hf_path=hf_dir, checkpoint=ckpt_dir, dtype="fp32", tp=tp,
                              pp=pp, max_seq_len=seq_len,
                              **({"expert_model_parallel_size": ep} if ep > 1 else {}))
    out = megatron_logits(model, tokens)
    # Every data-parallel rank (there are ep of them) computes the same logits: one reports.
    if out is not None and parallel_state.get_tensor_model_parallel_rank() == 0 \
            and parallel_state.get_data_parallel_rank() == 0:
        out = out[..., : arch.vocab_size] if role == "actor" else out
        if results is not None:
            results.put(out)
        else:
            torch.save(out, os.path.join(os.environ["VERIFY_OUT"], "logits.pt"))
    parallel_state.destroy_model_parallel()
    dist.barrier()
    if results is not None:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def verify(hf_dir: str, ckpt_dir: str, tp: int = 1, pp: int = 1, batch: int = 2,
           seq_len: int = 16, ep: int = 1) -> dict[str, float]:
    """Max absolute and relative (to max |HF logit|) difference between megatron on the dist
    checkpoint at TP x PP (x EP for a MoE model: the experts split over `ep` data-parallel
    ranks) and transformers on the HF directory, over random prompts.

    Spawns tp * pp * ep local ranks (gloo on CPU, NCCL on GPUs). A sliding window at least
    `seq_len` long never takes effect on these prompts, so such a config is compared too.
    """
    arch = read_hf_arch(hf_dir, max_seq_len=seq_len)
    if ep > 1 and arch.moe is None:
        raise ValueError(f"verify: ep={ep} needs a mixture-of-experts model; {hf_dir} is a "
                         f"dense {arch.model_type}")
    tokens = prompts(arch.vocab_size, batch, seq_len)
    world = tp * pp * ep
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, hf_dir, ckpt_dir, tp, pp, tokens,
                                                   results, ep)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        ours = None
        while ours is None:
            try:
                ours = results.get(timeout=5)
            except Exception:  # noqa: BLE001 - queue.Empty: check for dead ranks
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"verify: rank(s) {dead} failed (exit codes "
                                       f"{[procs[r].exitcode for r in dead]})") from None
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    ref = transformers_logits(hf_dir, tokens)
    diff = (ours - ref).abs().max().item()
    return {"max_abs": diff, "max_rel": diff / max(ref.abs().max().item(), 1e-30)}
