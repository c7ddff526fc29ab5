"""One call from config fields to this rank's model: `model.path` (HF) or `model.checkpoint`."""
from __future__ import annotations

import os
from typing import Any, Optional

from verl_mcore.models.checkpoint import load_dist_checkpoint
from verl_mcore.models.gpt import build_gpt_model
from verl_mcore.models.hf_config import HFArch, read_hf_arch, transformer_config
from verl_mcore.models.hf_weights import load_hf_weights
from verl_mcore.models.hub import local_dir

# Where hf-to-mcore keeps config.json and tokenizer files inside a dist checkpoint.
CKPT_HF_CONFIG_SUBDIR = "hf_config"


def build_and_load(role: str, *, hf_path: Optional[str] = None, checkpoint: Optional[str] = None,
                   dtype: str = "bf16", tp: int = 1, pp: int = 1, pg_collection=None,
                   max_seq_len: Optional[int] = None, core_attention: str = "sdpa",
                   **config_overrides: Any) -> tuple[Any, HFArch]:
    """Build `role`'s GPTModel stage for this rank and fill it.

    `checkpoint` (a dist checkpoint, any TP/PP) wins over `hf_path`; without it the weights are
    read from the HF directory (or Hub id: models/hub.py) straight into this rank's TP/PP slice. The
    architecture comes from `hf_path`, else from the copy of config.json the converter stores
    in the checkpoint. `config_overrides` go to TransformerConfig.
    """
    if hf_path is None and checkpoint is None:
        raise ValueError("build_and_load: give model.path (HF) or model.checkpoint (dist)")
    if hf_path is not None:
        hf_dir = local_dir(hf_path, key="hf_path")
    else:
        hf_dir = os.path.join(checkpoint, CKPT_HF_CONFIG_SUBDIR)
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise FileNotFoundError(f"{checkpoint}: no {CKPT_HF_CONFIG_SUBDIR}/config.json; also "
                                    "give model.path (an HF directory of the same architecture)")
    arch = read_hf_arch(hf_dir, max_seq_len=max_seq_len)
    config = transformer_config(arch, tp=tp, pp=pp, dtype=dtype, **config_overrides)
    model = build_gpt_model(arch, config, role=role, pg_collection=pg_collection,
                            core_attention=core_attention)
    if checkpoint is not None:
        load_dist_checkpoint(model, checkpoint, role=role)
    else:
        load_hf_weights(model, arch, hf_dir, role=role)
    return model, arch
