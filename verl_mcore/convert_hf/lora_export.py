"""A LoRA actor checkpoint -> a peft adapter directory, or a merged Hugging Face model.

    verl-mcore-convert-hf mcore-to-hf --ckpt RUN/checkpoints/actor/step_N --out ADAPTER
    verl-mcore-convert-hf mcore-to-hf --ckpt RUN/checkpoints/actor/step_N --out MODEL --merge

A LoRA run's checkpoints hold the adapters only (engine/checkpoint.py): meta.json says so
(`trainable_only`) and names the base they adapt (`base_weights`: the HF directory or dist
checkpoint the run started from), and config.yaml, the run's resolved config, gives their r,
alpha, target modules and dropout (`actor.lora`). dist_checkpointing stores every adapter tensor
in its global shape, stacked over layers, whatever TP/PP it was saved at, so each layer's
A [r, in] and B [out, r] are read whole:

    decoder.layers.3.self_attention.lora_linear_qkv.lora_A.q_proj        (lora.checkpoint_key)
        -> base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (lora.peft_key)

The adapter directory (adapter_config.json from lora.peft_config, adapter_model.safetensors)
loads with peft.PeftModel.from_pretrained and as a run's actor.lora.init_from. A merged model is
every base tensor, each targeted module's weight replaced by W + (alpha / r)·B·A (computed in
fp32, rounded once to W's dtype), with the base's config.json and tokenizer files.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

import torch
import yaml

from verl_mcore.config.loading import ConfigError, from_dict
from verl_mcore.config.resume import ARCH_FILE, CONFIG_FILE
from verl_mcore.config.schema import LoRAConfig
from verl_mcore.convert_hf.convert import (
    DEFAULT_MAX_SHARD_BYTES,
    MODEL_PREFIXES,
    HFGroup,
    _Output,
    checkpoint_dirs,
    dist_hf_groups,
    release_freed_tensors_to_os,
    write_hf_dir,
)
from verl_mcore.convert_hf.dist_ckpt import DistCheckpointReader
from verl_mcore.utils import manifest
from verl_mcore.engine.checkpoint import META
from verl_mcore.utils.safe_read import BadCheckpointError, read_json
from verl_mcore.models import lora as lora_lib
from verl_mcore.models.hf_config import read_hf_arch
from verl_mcore.models.hf_weights import HFCheckpoint
from verl_mcore.models.load import CKPT_HF_CONFIG_SUBDIR

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A stored adapter key: decoder.layers.<parent>.lora_<linear>.lora_<A|B>.<target> (layers
# stacked), or lora_output_layer.lora_<A|B>.lm_head (the output layer's, B with padded rows).
_ADAPTER_KEY = re.compile(
    r"^(?:decoder\.layers\.\w+\.lora_linear_\w+|lora_output_layer)\.lora_([AB])\.(\w+)$")


@dataclasses.dataclass
class LoRACheckpoint:
    """The adapters of one LoRA checkpoint and what they adapt."""

    step_dir: str
    reader: DistCheckpointReader
    lora: LoRAConfig  # the checkpoint's actor.lora
    targets: tuple[str, ...]  # HF module names, lora.HF_TARGETS order
    num_layers: Optional[int]  # None: no decoder layer is adapted (lm_head alone)
    base: Optional[str]  # meta.json's base_weights
    model_path: Optional[str]  # config.yaml's model.path (the run's HF config and tokenizer)

    @property
    def scale(self) -> float:
        return self.lora.alpha / self.lora.r

    def adapter(self, layer: Optional[int], target: str, vocab_size: Optional[int] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """A [r, in], B [out, r] of one module, unsharded, in their stored dtype; lm_head's B
        cut to the HF model's `vocab_size` rows (the checkpoint's are padded)."""
        a, b = (self.reader.read(lora_lib.checkpoint_key(layer, target, which))
                for which in ("A", "B"))
        if target == lora_lib.HEAD:
            b = b[:vocab_size]
        return a, b

    def modules(self) -> list[tuple[Optional[int], str]]:
        """(layer, target) of every adapted module, lm_head's layer None."""
        layers = [(layer, t) for layer in range(self.num_layers or 0) for t in self.targets
                  if t != lora_lib.HEAD]
        return layers + ([(None, lora_lib.HEAD)] if lora_lib.HEAD in self.targets else [])

    def peft_tensors(self, vocab_size: Optional[int] = None) -> dict[str, torch.Tensor]:
        """{peft_key: tensor} of every adapter (`vocab_size`: the HF model's, for lm_head)."""
        out = {}
        for layer, target in self.modules():
            a, b = self.adapter(layer, target, vocab_size)
            out[lora_lib.peft_key(layer, target, "A")] = a
            out[lora_lib.peft_key(layer, target, "B")] = b
        return out


def open_checkpoint(ckpt: str) -> tuple[DistCheckpointReader, Optional[LoRACheckpoint]]:
    """The dist checkpoint of `ckpt` (a step directory or its dist/; checked by the reader: the
    manifest, then the metadata) and, when it holds LoRA adapters, their description (None:
    full weights). ConfigError, naming the file, when the adapters cannot be described: a dist
    directory without the step directory's meta.json and config.yaml, a checkpoint that trains
    more than adapters, a config.yaml whose actor.lora does not match the stored tensors."""
    step_dir, dist_dir = checkpoint_dirs(ckpt)
    if step_dir:
        _check_against_manifest(step_dir, (META, CONFIG_FILE, ARCH_FILE))
    meta = read_json(os.path.join(step_dir, META)) if step_dir else None
    reader = DistCheckpointReader(dist_dir)
    if meta is not None and not meta.get("trainable_only"):
        return reader, None  # a trainer checkpoint of a fully trained model
    stored = reader.metadata.state_dict_metadata
    adapters = {}  # target -> stored global shapes {"A": [L, r, in], "B": [L, out, r]}
    others = []
    for key in stored:
        match = _ADAPTER_KEY.match(key)
        if match:
            adapters.setdefault(match.group(2), {})[match.group(1)] = tuple(stored[key].size)
        elif key.startswith(MODEL_PREFIXES) and not key.endswith("_extra_state") \
                and hasattr(stored[key], "size"):
            others.append(key)
    if meta is None:
        if not adapters:
            return reader, None  # a dist checkpoint of full weights (hf-to-mcore's)
        raise ConfigError(
            f"--ckpt {ckpt}: {dist_dir} holds LoRA adapters only, and no {META} / {CONFIG_FILE} "
            f"is beside it: the export reads the base the adapters belong to from the step "
            f"directory's {META} (base_weights) and their r, alpha, target_modules and dropout "
            f"from its {CONFIG_FILE} (actor.lora); pass the whole step directory "
            f"(RUN/checkpoints/actor/step_N) that holds them")
    if others or not adapters:
        raise ConfigError(
            f"--ckpt {ckpt}: {META} says it holds only trainable tensors, but "
            + (f"besides LoRA adapters it trains {sorted(others)[:4]} (a critic's value head?), "
               "which a peft LoRA adapter cannot carry" if others else
               "it has no LoRA adapter (decoder.layers.*.lora_*)")
            + "; only an actor's LoRA checkpoint exports")
    config_file = os.path.join(step_dir, CONFIG_FILE)
    try:
        with open(config_file) as f:
            saved = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--ckpt {ckpt}: no readable {CONFIG_FILE} in {step_dir} ({e}): the "
                          "export reads actor.lora (r, alpha, target_modules, dropout) from the "
                          "run's config an actor checkpoint carries (a critic's has none)") from e
    lora_dict = ((saved or {}).get("actor") or {}).get("lora")
    if not isinstance(lora_dict, dict):
        raise ConfigError(f"{config_file}: no actor.lora section (a LoRA run's config has one)")
    lora = from_dict(LoRAConfig, lora_dict, prefix="actor.lora.")
    targets = lora_lib.resolve_targets(lora.target_modules)
    if set(targets) != set(adapters) or any(  # A: [L, r, in] stacked, lm_head's [r, h]
            set(s) != {"A", "B"} or s["A"][-2] != lora.r for s in adapters.values()):
        raise ConfigError(
            f"{config_file}: actor.lora (r={lora.r}, target_modules={list(targets)}) does not "
            f"describe the adapters in {dist_dir} (targets {sorted(adapters)}, A of shape "
            f"{ {t: s.get('A') for t, s in sorted(adapters.items())} }); the checkpoint's files "
            "are not of one run")
    num_layers = next((s["A"][0] for t, s in adapters.items() if t != lora_lib.HEAD), None)
    return reader, LoRACheckpoint(step_dir, reader, lora, targets, num_layers,
                                  meta.get("base_weights"),
                                  ((saved or {}).get("model") or {}).get("path"))


def export_peft(ckpt: LoRACheckpoint, out_dir: str, base: Optional[str] = None,
                force: bool = False) -> str:
    """adapter_config.json + adapter_model.safetensors of `ckpt` in out_dir; its
    base_model_name_or_path is `base`, else the recorded base when that is an HF directory,
    else the run's model.path (a dist checkpoint base is no model peft can name)."""
    from safetensors.torch import save_file

    named = base
    if named is None:
        recorded = ckpt.base
        named = recorded if recorded and _is_hf_dir(recorded) else ckpt.model_path or recorded
    tensors = ckpt.peft_tensors(_vocab_size(ckpt, named))
    out = _Output(out_dir, force, _inputs(ckpt, base))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(out.tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(out.tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(lora_lib.peft_config(ckpt.lora, named or ""), f, indent=2)
    except BaseException:
        out.abort()
        raise
    return out.commit()


def export_merged(ckpt: LoRACheckpoint, out_dir: str, base: Optional[str] = None,
                  hf_template: Optional[str] = None, force: bool = False, progress: bool = True,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """A full HF model: the base's tensors (from `base`, default the recorded one: an HF
    directory or a dist checkpoint) with the adapters merged in; config.json and tokenizer
    files from `hf_template`, else the base (an HF directory, or a dist checkpoint's stored
    copy)."""
    base_dir = _base_weights(ckpt, base)
    release_freed_tensors_to_os()
    groups, meta_src = _base_tensors(base_dir, hf_template)
    arch = read_hf_arch(meta_src)
    if ckpt.num_layers is not None and arch.num_layers != ckpt.num_layers:
        raise ConfigError(f"the base {base_dir} has {arch.num_layers} layers, the adapters of "
                          f"{ckpt.step_dir} {ckpt.num_layers}; pass --base with the model the "
                          "run trained")
    modules = {f"{lora_lib.hf_module(layer, t)}.weight": (layer, t) for layer, t in ckpt.modules()}
    missing = sorted(set(modules) - {name for entries, _ in groups for name, _, _ in entries})
    if missing:
        raise ConfigError(f"the base {base_dir} has no {missing[:3]}: not the model the adapters "
                          f"of {ckpt.step_dir} were trained on; pass --base with that one")

    def merge(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, weight in tensors.items():
            if name in modules:
                a, b = ckpt.adapter(*modules[name], vocab_size=weight.shape[0])
                delta = (b.float() @ a.float()) * ckpt.scale
                tensors[name] = (weight.float() + delta).to(weight.dtype)
        return tensors

    merged = [(entries, lambda produce=produce: merge(produce())) for entries, produce in groups]
    return write_hf_dir(out_dir, merged, meta_src, force=force, progress=progress,
                        max_shard_bytes=max_shard_bytes, desc="mcore-to-hf --merge",
                        inputs={**_inputs(ckpt, base), "--hf-template": hf_template})


def _inputs(ckpt: LoRACheckpoint, base: Optional[str]) -> dict[str, Optional[str]]:
    """Every path an export of `ckpt` reads or names, by the flag or record it comes from."""
    return {"--ckpt": ckpt.step_dir, "--base": base,
            f"base_weights of {os.path.join(ckpt.step_dir, META)}": ckpt.base,
            f"model.path of {os.path.join(ckpt.step_dir, CONFIG_FILE)}": ckpt.model_path}


def _vocab_size(ckpt: LoRACheckpoint, base: Optional[str]) -> Optional[int]:
    """The HF vocabulary an lm_head adapter is cut to (None when lm_head is not adapted): from
    the config.json of `base`, the recorded base or the run's model.path, or a dist
    checkpoint base's stored HF config."""
    if lora_lib.HEAD not in ckpt.targets:
        return None
    for path in (base, ckpt.base, ckpt.model_path):
        for where in (path, path and os.path.join(path, CKPT_HF_CONFIG_SUBDIR)):
            if where and _is_hf_dir(where):
                return read_hf_arch(where).vocab_size
    raise ConfigError(f"{ckpt.step_dir}: the lm_head adapter's rows are padded, and no "
                      "config.json of the base model is found to cut them to its vocabulary "
                      f"(base_weights {ckpt.base}, model.path {ckpt.model_path}); pass --base "
                      "with the HF directory the run trained")


def _base_tensors(base: str, hf_template: Optional[str]) -> tuple[list[HFGroup], str]:
    """The HF tensors of the base (an HF directory: one group per tensor; a dist checkpoint: per
    megatron tensor, a fused QKV giving q, k, v) and the directory of its config.json and
    tokenizer (hf_template, else the base's own)."""
    if _is_hf_dir(base):
        hf = HFCheckpoint(base)
        groups = []
        for name in hf.names():
            shape, dtype = hf.shape_dtype(name)
            groups.append(([(name, tuple(shape), dtype)], lambda name=name: {name: hf.read(name)}))
        return groups, hf_template or base
    meta_src = hf_template or os.path.join(base, CKPT_HF_CONFIG_SUBDIR)
    if not _is_hf_dir(meta_src):
        raise ConfigError(f"the base {base} is a dist checkpoint without the HF config "
                          f"hf-to-mcore stores in {CKPT_HF_CONFIG_SUBDIR}/; pass --hf-template "
                          "PATH (the HF directory it was converted from)")
    arch = read_hf_arch(meta_src)
    return dist_hf_groups(DistCheckpointReader(base), arch, "actor", meta_src), meta_src


def _base_weights(ckpt: LoRACheckpoint, base: Optional[str]) -> str:
    """The base to merge into: --base, else meta.json's record; either must exist."""
    recorded = os.path.join(ckpt.step_dir, META)
    if base is None:
        if not ckpt.base:
            raise ConfigError(f"{recorded} records no base_weights (the model the adapters were "
                              "trained on); pass --base PATH: its HF directory or dist checkpoint")
        if not os.path.exists(ckpt.base):
            raise ConfigError(f"{recorded} records the base weights at {ckpt.base}, which no "
                              "longer exists; pass --base PATH (the HF directory or dist "
                              "checkpoint the run started from)")
        base = ckpt.base
    if not (_is_hf_dir(base) or os.path.isfile(os.path.join(base, "metadata.json"))):
        raise ConfigError(f"--base {base}: neither an HF model directory (config.json) nor a "
                          "dist checkpoint (metadata.json)")
    return base


def _check_against_manifest(step_dir: str, names) -> None:
    """The step directory's files that the export parses, against its manifest when it has one
    (the reader checks dist/ itself): BadCheckpointError naming the file that changed."""
    files = manifest.read_manifest(step_dir)
    if files is None:
        return  # saved before manifests: engine/checkpoint.py loads these with a warning too
    for rel in names:
        path = os.path.join(step_dir, rel)
        if rel not in files:
            if os.path.exists(path):
                raise BadCheckpointError(f"{path}: not in {manifest.MANIFEST}: added after the "
                                         "checkpoint was saved")
            continue
        got = manifest.hash_files(step_dir, [rel])[rel] if os.path.isfile(path) else None
        if got != files[rel]:
            raise BadCheckpointError(f"{path}: {'missing' if got is None else 'changed'} since "
                                     f"the save ({manifest.MANIFEST} lists it); the checkpoint "
                                     "is damaged: export another step")


def _is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))

