"""One call from config fields to this rank's model: `model.path` (HF) or `model.checkpoint`."""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from verl_mcore.models.checkpoint import load_dist_checkpoint
from verl_mcore.models.gpt import build_gpt_model
from verl_mcore.models.hf_config import HFArch, read_hf_arch, transformer_config
from verl_mcore.models.hf_weights import load_hf_weights
from verl_mcore.models.hub import local_dir
from verl_mcore.utils.doing import doing

log = logging.getLogger("verl_mcore.models.load")

# Where hf-to-mcore keeps config.json and tokenizer files inside a dist checkpoint (and the
# trainer inside each actor checkpoint's dist/).
CKPT_HF_CONFIG_SUBDIR = "hf_config"

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# A Hub snapshot's top level can hold other large files (an .onnx export, images): a copy kept
# in every checkpoint takes the config and tokenizer (a few MB), never those.
MAX_METADATA_FILE_BYTES = 64 * 1024**2


def metadata_files(src: str) -> list[str]:
    """The names of src's top-level non-weight files: config.json, generation_config.json,
    tokenizer files, chat template ..."""
    return [name for name in sorted(os.listdir(src))
            if os.path.isfile(os.path.join(src, name)) and not name.endswith(_WEIGHT_SUFFIXES)
            and name not in _WEIGHT_INDEXES]


def hf_config_copy(hf_dir: str, tokenizer_dir: Optional[str] = None) -> dict[str, bytes]:
    """{name: content} of the HF files a model's weights need beside them to be an HF model
    again: hf_dir's non-weight files, with a separate tokenizer directory's (model.tokenizer)
    over them by name, but the model's own config.json and generation_config.json kept. Read
    once, when the run starts: the files the run's model was built from, even if the directory
    changes later. Files over MAX_METADATA_FILE_BYTES are left out, with a warning naming them."""
    out: dict[str, bytes] = {}
    sources = [(hf_dir, ())]
    if tokenizer_dir and os.path.realpath(tokenizer_dir) != os.path.realpath(hf_dir):
        sources.append((tokenizer_dir, ("config.json", "generation_config.json")))
    for src, keep_model_files in sources:
        for name in metadata_files(src):
            path = os.path.join(src, name)
            if name in keep_model_files:
                continue
            if os.path.getsize(path) > MAX_METADATA_FILE_BYTES:
                log.warning("%s (%.0f MiB) is not copied into the checkpoints' %s/: only config "
                            "and tokenizer files are", path, os.path.getsize(path) / 2**20,
                            CKPT_HF_CONFIG_SUBDIR)
                continue
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


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
    with doing(f"building the {role} model ({arch.num_layers} layers, TP {tp} x PP {pp})"):
        model = build_gpt_model(arch, config, role=role, pg_collection=pg_collection,
                                core_attention=core_attention)
    with doing(f"loading the {role} weights from {checkpoint or hf_dir}"):
        if checkpoint is not None:
            load_dist_checkpoint(model, checkpoint, role=role)
        else:
            load_hf_weights(model, arch, hf_dir, role=role)
    return model, arch
