"""Compare a megatron model (from a dist checkpoint, at a TP x PP layout) with transformers.

`verify` runs on tp * pp ranks: under torchrun / srun it uses the launched ranks; otherwise it
spawns them itself on this machine (gloo on CPU, NCCL on GPUs). Every rank builds its stage of the
model, loads its slice of the checkpoint and runs the same prompts; the last pipeline stage
gathers the vocabulary-parallel logits, and rank 0 of the job compares them with the logits of
`transformers.AutoModelForCausalLM` on the HF directory (in fp32).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

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
    if isinstance(model.output_layer, torch.nn.Module) and logits.shape[-1] != 1 and \
            parallel_state.get_tensor_model_parallel_world_size() > 1 and \
            logits.shape[-1] != model.vocab_size:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits.float().cpu()
