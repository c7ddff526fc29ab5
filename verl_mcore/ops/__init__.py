"""Public ops with one meaning on every device: the CUDA kernels of csrc/ on GPUs when the extension
is loaded (decided once, at import: see `_extension.py` and `VERL_MCORE_OPS`), the pure-torch
reference otherwise. The reference is also the test oracle of the kernels.

    gae(rewards, values, mask, gamma, lam) -> (advantages, returns)          [batch, T]
    gae_whitened(rewards, values, mask, gamma, lam, eps=1e-8, group=None)    [batch, T]
    logprob_entropy(logits, target, tp_group=None, temperature=1.0,
                    vocab_start=None, compute_entropy=True) -> (logp, entropy) [tokens]
"""
from verl_mcore.ops._extension import extension_status
from verl_mcore.ops.gae import gae, gae_whitened
from verl_mcore.ops.logprob_entropy import logprob_entropy

__all__ = ["extension_status", "gae", "gae_whitened", "logprob_entropy"]
