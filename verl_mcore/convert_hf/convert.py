"""HF directory <-> megatron-core dist checkpoint, streaming one tensor at a time.

Both directions plan every output tensor's shape first (by running the weight map on `meta`
tensors), then produce and write tensors one at a time: peak host memory is about twice the
largest tensor plus a fixed overhead, whatever the model size. Output goes to a temporary
sibling directory that is renamed into place at the end, so an interrupted run never leaves a
directory that looks complete.

The dist checkpoint keeps the HF config and tokenizer files under `hf_config/`, so mcore-to-hf
needs no template for a checkpoint made by hf-to-mcore or saved by the trainer (an actor
checkpoint's dist/ carries the files the run started from), conversion.json (the --max-seq-len a
sliding-window config was converted under), and a manifest.json (size and SHA-256 of every file,
verl_mcore/utils/manifest.py) that every load checks first. mcore-to-hf checks a template
against the checkpoint's record of its architecture and its tensors before writing.

No command writes its output over, above or inside one of its inputs (check_output_apart).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from typing import Callable, Mapping, Optional, Sequence

import torch
import yaml
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from tqdm import tqdm

from verl_mcore.config.loading import ConfigError
from verl_mcore.config.resume import ARCH_FILE, CONFIG_FILE
from verl_mcore.convert_hf.dist_ckpt import (
    Chunk,
    DistCheckpointReader,
    KeyLayout,
    chunks_for,
    extra_state_keys,
    write_dist_checkpoint,
)
from verl_mcore.convert_hf.safetensors_stream import write_safetensors
from verl_mcore.engine.checkpoint import DIST_DIR, META
from verl_mcore.utils.manifest import MANIFEST, build_manifest
from verl_mcore.utils.safe_read import read_json
from verl_mcore.models import weight_map as wm
from verl_mcore.models.hf_config import HFArch, parse_dtype, read_hf_arch
from verl_mcore.models.hf_weights import HFCheckpoint, check_tensors, check_weight_files
from verl_mcore.models.load import CKPT_HF_CONFIG_SUBDIR as HF_CONFIG_SUBDIR
from verl_mcore.models.load import metadata_files

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# hf-to-mcore's arguments that later reads of the stored config.json need ({"max_seq_len": N}).
CONVERSION_RECORD = "conversion.json"
# A dist checkpoint's model tensors; a trainer's holds optimizer state beside them.
MODEL_PREFIXES = ("decoder.", "embedding.", "output_layer.")


def release_freed_tensors_to_os() -> None:
    """Make glibc return each freed tensor buffer to the OS.

    glibc raises its mmap threshold (up to 32 MiB) every time a large block is freed, after which
    tensor-sized blocks come from the heap and stay there when freed: streaming a checkpoint then
    grows RSS by several tensors' worth of retained heap. A fixed 1 MiB threshold keeps every
    tensor buffer in its own mapping, unmapped on free. No-op where mallopt is unavailable.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_mmap_threshold = -3
        libc.mallopt(m_mmap_threshold, 1 << 20)
    except (OSError, AttributeError):
        pass


def copy_metadata_files(src: str, dst: str) -> None:
    """config.json, generation_config.json, tokenizer files ...: every non-weight file of src."""
    os.makedirs(dst, exist_ok=True)
    for name in metadata_files(src):
        shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


def check_output_apart(out_dir: str, inputs: Mapping[str, Optional[str]]) -> None:
    """Refuse an output directory that is, contains or lies inside one of `inputs` ({the flag
    or key the user gave it by: path}; None and paths that do not exist are skipped), with
    symlinks and relative paths resolved. Replacing such a directory (--force) deletes the
    input; writing inside one changes a directory the command reads (a checkpoint's
    manifest.json then lists other files, and every later load refuses the checkpoint)."""
    out = os.path.realpath(out_dir)
    for flag, path in inputs.items():
        if not path or not os.path.exists(path):
            continue
        src = os.path.realpath(path)
        if out == src:
            where, harm = "is", "replacing it (--force) would delete the input"
        elif _is_inside(src, out):
            where, harm = "contains", "replacing it (--force) would delete the input"
        elif _is_inside(out, src):
            where, harm = "lies inside", ("writing there adds files to a directory this command "
                                          "reads (a checkpoint's manifest.json no longer matches "
                                          "and every later load refuses it)")
        else:
            continue
        resolved = "" if (out, src) == (out_dir, path) else f" (resolved: {out}, {src})"
        raise ConfigError(f"--out {out_dir} {where} {flag} {path}{resolved}: {harm}; choose an "
                          f"--out outside {src} that does not contain it")


def _is_inside(path: str, parent: str) -> bool:
    return path != parent and os.path.commonpath([path, parent]) == parent


class _Output:
    """A temporary sibling of `out_dir` that becomes `out_dir` on commit(). `inputs`: every
    path the command reads, by flag (check_output_apart), refused before anything is written."""

    def __init__(self, out_dir: str, force: bool, inputs: Mapping[str, Optional[str]]):
        check_output_apart(out_dir, inputs)
        self.out_dir = os.path.abspath(out_dir)
        if os.path.exists(self.out_dir) and not force:
            raise FileExistsError(f"{self.out_dir} exists; pass --force to overwrite it")
        self.tmp = f"{self.out_dir}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)

    def commit(self) -> str:
        old = None
        if os.path.exists(self.out_dir):
            old = f"{self.out_dir}.old-{os.getpid()}"
            os.rename(self.out_dir, old)
        os.rename(self.tmp, self.out_dir)
        if old is not None:
            shutil.rmtree(old)
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def checkpoint_dirs(ckpt: str) -> tuple[Optional[str], str]:
    """(the trainer's step directory, or None; its dist checkpoint) of a --ckpt that names
    either a step directory (…/checkpoints/actor/step_N) or a dist checkpoint directory."""
    ckpt = os.path.abspath(ckpt)
    if os.path.isfile(os.path.join(ckpt, META)) and os.path.isdir(os.path.join(ckpt, DIST_DIR)):
        return ckpt, os.path.join(ckpt, DIST_DIR)
    parent = os.path.dirname(ckpt)
    if os.path.basename(ckpt) == DIST_DIR and os.path.isfile(os.path.join(parent, META)):
        return parent, ckpt
    return None, ckpt


def _role_of(arch: HFArch) -> str:
    return "reward" if arch.num_labels is not None else "actor"


def _progress(total_bytes: int, enabled: bool, desc: str) -> tqdm:
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, disable=not enabled)


# --------------------------------------------------------------------------------------------
# HF -> mcore

def hf_to_mcore_chunks(hf_dir: str, arch: HFArch, dtype: Optional[torch.dtype]) -> list[Chunk]:
    """Every chunk of the dist checkpoint, each producing its tensor from the HF files. Reads
    only headers: every tensor's presence, dtype and shape against config.json are checked here,
    and tensors nothing reads are warned of. dtype None keeps each tensor's HF dtype, except
    that F64 is written as F32 (the exporter and the trainer serve bf16/fp16/fp32)."""
    ckpt = HFCheckpoint(hf_dir)
    unused = check_tensors(ckpt, arch, _role_of(arch))
    if unused:
        warnings.warn(f"{hf_dir}: {len(unused)} tensors are not used by a {arch.model_type} of "
                      f"{arch.num_layers} layers (config.json), e.g. {unused[:5]}; they are "
                      "left out of the conversion")
    padded = arch.padded_vocab_size(1)
    layout = KeyLayout.of(arch)
    chunks: list[Chunk] = []
    for pm in wm.param_maps(arch, _role_of(arch)):
        metas = []
        for name in pm.hf:
            shape, src_dtype = ckpt.shape_dtype(name)
            kept = torch.float32 if src_dtype == torch.float64 else src_dtype
            metas.append(torch.empty(shape, dtype=dtype or kept, device="meta"))
        out_dtype = metas[0].dtype
        full = wm.hf_to_mcore(pm, arch, metas, padded)  # shape inference only

        def read(name, out_dtype=out_dtype):
            return ckpt.read(name).to(out_dtype)

        if pm.kind == "gate_up":
            # Megatron stores gate and up as two chunks: read one HF tensor per chunk.
            produce = (lambda half, pm=pm, read=read: read(pm.hf[half]))
        else:
            produce = (lambda pm=pm, read=read: wm.hf_to_mcore(pm, arch, [read(n) for n in pm.hf],
                                                               padded))
        chunks += chunks_for(pm.mcore, full.shape, layout, out_dtype, produce,
                             split_halves=pm.kind == "gate_up")
    return chunks


def convert_hf_to_mcore(hf_dir: str, out_dir: str, dtype: Optional[str] = None,
                        force: bool = False, progress: bool = True,
                        max_seq_len: Optional[int] = None) -> str:
    """Write a megatron dist checkpoint (loadable at any TP/PP) from an HF directory.

    `dtype` "bf16"/"fp32"/"fp16" casts every tensor; None keeps the HF dtype.
    """
    arch = read_hf_arch(hf_dir, max_seq_len=max_seq_len)
    check_weight_files(hf_dir, key="--hf")  # a cut or damaged file, named, before anything is written
    chunks = hf_to_mcore_chunks(hf_dir, arch, parse_dtype(dtype) if dtype else None)
    release_freed_tensors_to_os()
    out = _Output(out_dir, force, {"--hf": hf_dir})
    try:
        bar = _progress(sum(c.nbytes for c in chunks), progress, "hf-to-mcore")
        bar.set_postfix_str(f"0/{len(chunks)} tensors")
        done = [0]

        def on_written(c: Chunk) -> None:
            done[0] += 1
            bar.update(c.nbytes)
            bar.set_postfix_str(f"{done[0]}/{len(chunks)} tensors", refresh=False)

        extra = extra_state_keys((pm.mcore for pm in wm.param_maps(arch, _role_of(arch))),
                                 KeyLayout.of(arch))
        write_dist_checkpoint(out.tmp, chunks, extra, on_written)
        bar.close()
        copy_metadata_files(hf_dir, os.path.join(out.tmp, HF_CONFIG_SUBDIR))
        # A sliding-window config reads only with the sequence bound it was converted under:
        # mcore-to-hf reads the stored config.json again.
        with open(os.path.join(out.tmp, CONVERSION_RECORD), "w") as f:
            json.dump({"max_seq_len": max_seq_len}, f)
        with open(os.path.join(out.tmp, MANIFEST), "w") as f:  # last: it covers every file
            json.dump(build_manifest(out.tmp), f, indent=1)
    except BaseException:
        out.abort()
        raise
    return out.commit()


# --------------------------------------------------------------------------------------------
# mcore -> HF

def _hf_plan(reader: DistCheckpointReader, arch: HFArch, role: str):
    """[(ParamMap, [(hf_name, shape, dtype), ...])] in output order."""
    plan = []
    layout = KeyLayout.of(arch)
    for pm in wm.param_maps(arch, role):
        key, prefix, _ = layout.locate(pm.mcore)
        md = reader.tensor_meta(key)
        shape = tuple(md.size)[len(prefix):]
        meta = torch.empty(shape, dtype=md.properties.dtype, device="meta")
        hf = wm.mcore_to_hf(pm, arch, meta)
        plan.append((pm, [(name, tuple(t.shape), t.dtype) for name, t in hf.items()]))
    return plan


def _checkpoint_role(reader: DistCheckpointReader, arch: HFArch) -> str:
    if arch.num_labels is not None:
        return "reward"
    if reader.has("output_layer.weight") and \
            reader.tensor_meta("output_layer.weight").size[0] < arch.vocab_size:
        raise ValueError(f"{reader.ckpt_dir}: output_layer.weight is a scalar head but the HF "
                         "config is a causal LM; pass --hf-template of a "
                         "*ForSequenceClassification model to export a reward model")
    return "actor"


# (entries [(HF name, shape, dtype)], produce: () -> {HF name: tensor} in the entries' order)
HFGroup = tuple[list[tuple[str, tuple, torch.dtype]], Callable[[], dict[str, torch.Tensor]]]


def dist_hf_groups(reader: DistCheckpointReader, arch: HFArch, role: str,
                   config_src: str) -> list[HFGroup]:
    """The HF tensors of a dist checkpoint, one group per megatron tensor (a fused QKV gives
    q, k, v), each read when the writer reaches it. `arch` (read from `config_src`) is checked
    against the checkpoint first (check_checkpoint_arch)."""
    check_checkpoint_arch(reader, arch, role, config_src)
    layout = KeyLayout.of(arch)
    return [(entries, lambda pm=pm: wm.mcore_to_hf(pm, arch, reader.read(pm.mcore, layout)))
            for pm, entries in _hf_plan(reader, arch, role)]


def check_checkpoint_arch(reader: DistCheckpointReader, arch: HFArch, role: str,
                          config_src: str) -> None:
    """ConfigError, naming the field, the config's value and the checkpoint's, when the config
    read from `config_src` (--hf-template, or the copy hf-to-mcore stored) does not describe
    the checkpoint. Without this the export writes what the config describes: dropped layers,
    a cut embedding, a dropped LM head, another RoPE, all silently."""
    where = os.path.join(config_src, "config.json")
    record = _arch_record(reader.ckpt_dir)
    if record is not None:
        _check_against_record(arch, where, *record, reader.ckpt_dir)
    # hf-to-mcore pads at TP 1; the trainer records the padding it trained with.
    padded = (record[0].get("padded_vocab_size") if record else None) or arch.padded_vocab_size()
    _check_stored_tensors(reader, arch, role, where, padded)


def _check_against_record(arch: HFArch, where: str, saved: dict, record_path: str,
                          ckpt: str) -> None:
    """Every field of the checkpoint's record of its architecture equals the config's."""
    ours = _flat(json.loads(json.dumps(dataclasses.asdict(arch))))
    diffs = [f"{k} = {ours[k]!r} in the config, {v!r} in the checkpoint"
             for k, v in sorted(_flat(json.loads(json.dumps(saved))).items())  # tuples: lists
             if k in ours and k != "torch_dtype" and ours[k] != v]
    if diffs:
        raise ConfigError(f"{where} does not describe the checkpoint {ckpt} (as {record_path} "
                          "records it): " + "; ".join(diffs) + ". Pass --hf-template with the "
                          "model the checkpoint was trained or converted from")


def _check_stored_tensors(reader: DistCheckpointReader, arch: HFArch, role: str, where: str,
                          padded_vocab: int) -> None:
    """The checkpoint's model tensors are those of `arch`: as many stacked layers, none left
    unread (an untied LM head under a tied config) or missing, vocabulary rows exactly
    `padded_vocab`."""
    ckpt = reader.ckpt_dir
    stored = {key: tuple(md.size) for key, md in reader.metadata.state_dict_metadata.items()
              if key.startswith(MODEL_PREFIXES) and isinstance(md, TensorStorageMetadata)}
    layout = KeyLayout.of(arch)
    for key, shape in sorted(stored.items()):
        stacked = key.startswith("decoder.layers.") and not key.split(".")[2].isdigit()
        if stacked and shape[0] != arch.num_layers:
            raise ConfigError(f"{where}: num_hidden_layers = {arch.num_layers}, but the checkpoint "
                              f"{ckpt} holds {shape[0]} layers ({key} is stacked {list(shape)})")
    planned = {layout.locate(pm.mcore)[0] for pm in wm.param_maps(arch, role)}
    unread, missing = sorted(set(stored) - planned), sorted(planned - set(stored))
    if unread or missing:
        head = ""
        if "output_layer.weight" in unread + missing:
            head = (f" (tie_word_embeddings = {str(arch.tie_embeddings).lower()}: "
                    + ("the checkpoint's own LM head would be dropped)" if arch.tie_embeddings
                       else "the checkpoint's LM head is its embedding)"))
        raise ConfigError(f"{where} does not describe the tensors of the checkpoint {ckpt}"
                          + (f": it has no place for {unread[:4]}" if unread else "")
                          + (f"; it needs {missing[:4]}, which the checkpoint lacks" if missing
                             else "") + head)
    lm_head = ["output_layer.weight"] if role != "reward" and not arch.tie_embeddings else []
    for key in ["embedding.word_embeddings.weight"] + lm_head:
        if stored[key][0] != padded_vocab:
            raise ConfigError(f"{where}: vocab_size = {arch.vocab_size} (padded to "
                              f"{padded_vocab} rows), but {key} of the checkpoint {ckpt} has "
                              f"{stored[key][0]} rows")


def _arch_record(ckpt_dir: str) -> Optional[tuple[dict, str]]:
    """(the architecture a checkpoint was saved with, the file saying so): a trainer step's
    model_arch.json (padded_vocab_size included), else the config.json hf-to-mcore stored;
    None when there is neither."""
    step_dir, dist_dir = checkpoint_dirs(ckpt_dir)
    if step_dir and os.path.isfile(os.path.join(step_dir, ARCH_FILE)):
        path = os.path.join(step_dir, ARCH_FILE)
        return read_json(path), path
    stored = os.path.join(dist_dir, HF_CONFIG_SUBDIR)
    if os.path.isfile(os.path.join(stored, "config.json")):
        arch = read_hf_arch(stored, max_seq_len=conversion_max_seq_len(dist_dir))
        return dataclasses.asdict(arch), os.path.join(stored, "config.json")
    return None


def _flat(record: dict, prefix: str = "") -> dict:
    """{"rope": {"theta": 1}} -> {"rope.theta": 1}."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_source(ckpt_dir: str) -> str:
    """The directory whose config.json and tokenizer files belong to the dist checkpoint
    `ckpt_dir`: the copy inside it (hf-to-mcore's, and every actor checkpoint the trainer saves),
    else, for a trainer checkpoint saved before checkpoints carried that copy, the model.path its
    config.yaml records, when it is still there. ConfigError naming the files and --hf-template
    otherwise."""
    stored = os.path.join(ckpt_dir, HF_CONFIG_SUBDIR)
    if os.path.isfile(os.path.join(stored, "config.json")):
        return stored
    step_dir, _ = checkpoint_dirs(ckpt_dir)
    recorded = os.path.join(step_dir, CONFIG_FILE) if step_dir else None
    path = None
    if recorded and os.path.isfile(recorded):
        with open(recorded) as f:
            path = ((yaml.safe_load(f) or {}).get("model") or {}).get("path")
        if path and os.path.isfile(os.path.join(path, "config.json")):
            return path
    where = (f", nor at model.path {path} that {recorded} records (moved or deleted?)"
             if path else "")
    raise ConfigError(f"{os.path.join(stored, 'config.json')}: not in the checkpoint{where}; "
                      "pass --hf-template DIR, an HF directory of the model the checkpoint was "
                      "trained or converted from")


def conversion_max_seq_len(ckpt_dir: str) -> Optional[int]:
    """The --max-seq-len hf-to-mcore converted `ckpt_dir` with (None: not given, or not a
    checkpoint of hf-to-mcore)."""
    path = os.path.join(ckpt_dir, CONVERSION_RECORD)
    return read_json(path).get("max_seq_len") if os.path.isfile(path) else None


def convert_mcore_to_hf(ckpt_dir: str, out_dir: str, hf_template: Optional[str] = None,
                        force: bool = False, progress: bool = True,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        reader: Optional[DistCheckpointReader] = None) -> str:
    """Write safetensors shards + index + config/tokenizer files from a dist checkpoint
    (`reader`: the caller's reader of ckpt_dir, already checked). The config and tokenizer
    come from `hf_template`, else from the checkpoint (config_source)."""
    if hf_template is not None:
        if not os.path.isfile(os.path.join(hf_template, "config.json")):
            raise ConfigError(f"--hf-template {hf_template}: no config.json there; pass an HF "
                              "directory of the model the checkpoint was trained or converted from")
        meta_src = hf_template
    else:
        meta_src = config_source(ckpt_dir)
    reader = reader or DistCheckpointReader(ckpt_dir)  # its manifest covers conversion.json
    arch = read_hf_arch(meta_src, max_seq_len=conversion_max_seq_len(ckpt_dir))
    release_freed_tensors_to_os()
    groups = dist_hf_groups(reader, arch, _checkpoint_role(reader, arch), meta_src)
    step_dir, _ = checkpoint_dirs(ckpt_dir)
    return write_hf_dir(out_dir, groups, meta_src, force=force, progress=progress,
                        max_shard_bytes=max_shard_bytes, desc="mcore-to-hf",
                        inputs={"--ckpt": step_dir or ckpt_dir, "--hf-template": hf_template})


def write_hf_dir(out_dir: str, groups: Sequence[HFGroup], meta_src: str, force: bool = False,
                 progress: bool = True, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 desc: str = "hf", *, inputs: Mapping[str, Optional[str]]) -> str:
    """An HF directory of `groups`' tensors, in their order: safetensors shards of at most
    max_shard_bytes (a new shard when the next group would pass it) and their index, then
    meta_src's non-weight files (config.json with the weights' dtype, tokenizer). One group is
    produced and held at a time; written into a temporary sibling renamed at the end. `inputs`:
    every path the tensors come from, by flag (check_output_apart)."""
    shards: list[list[HFGroup]] = [[]]
    size = 0
    for group in groups:
        nbytes = sum(_nbytes(s, d) for _, s, d in group[0])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(group)
        size += nbytes
    total = sum(_nbytes(s, d) for entries, _ in groups for _, s, d in entries)
    dtypes = {d for entries, _ in groups for _, _, d in entries}

    out = _Output(out_dir, force, {**inputs, "meta_src": meta_src})
    try:
        bar = _progress(total, progress, desc)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            entries = [e for es, _ in shard for e in es]
            weight_map.update({name: fname for name, _, _ in entries})
            write_safetensors(os.path.join(out.tmp, fname), entries,
                              [produce for _, produce in shard], bar.update)
        bar.close()
        with open(os.path.join(out.tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        copy_metadata_files(meta_src, out.tmp)
        _set_config_dtype(os.path.join(out.tmp, "config.json"), dtypes)
    except BaseException:
        out.abort()
        raise
    return out.commit()


def _nbytes(shape, dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= int(s)
    return n


def _set_config_dtype(path: str, dtypes: set) -> None:
    """Record the exported weights' dtype in config.json (transformers reads `dtype`)."""
    if len(dtypes) != 1:
        return
    name = str(next(iter(dtypes))).removeprefix("torch.")
    with open(path) as f:
        cfg = json.load(f)
    before = dict(cfg)
    for key in ("dtype", "torch_dtype"):
        if key in cfg or key == "dtype":
            cfg[key] = name
    if cfg != before:  # else the template's file stays byte for byte
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)


# --------------------------------------------------------------------------------------------
# A built model -> HF (the Python API's Policy.save_pretrained)

class HFDirWriter:
    """An HF directory from (HF name, full tensor) pairs as a model streams them (rollout/
    vllm_engine.hf_weight_stream): safetensors shards of at most `max_shard_bytes` (a larger
    tensor goes alone) and their index, then at `commit` the non-weight files of `meta_src`
    (config.json with the weights' dtype, tokenizer, generation config) and, when given, the
    files of the caller's own tokenizer. Written into a temporary sibling of `out_dir` renamed
    at commit, so an interrupted save never leaves a directory that looks complete. Host
    memory: one shard.

        writer = HFDirWriter(out_dir, hf_dir)
        for bucket in stream:
            writer.add(bucket)
        writer.commit()          # or writer.abort()
    """

    def __init__(self, out_dir: str, meta_src: str, force: bool = False,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 inputs: Optional[Mapping[str, Optional[str]]] = None):
        if not os.path.isfile(os.path.join(meta_src, "config.json")):
            raise FileNotFoundError(f"{meta_src}: no config.json to write next to the weights")
        self.meta_src, self.max_shard_bytes = meta_src, max_shard_bytes
        # `inputs`: the caller's sources by the names its user gave them (model.path, ...).
        self._out = _Output(out_dir, force, {**(inputs or {}), "meta_src": meta_src})
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # the tensor names of each written shard
        self._total = 0
        self._dtypes: set = set()

    def add(self, tensors) -> None:
        """More (HF name, tensor) pairs, in the order they are to be stored."""
        for name, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
                self._flush()
            # A copy, also on the host: the stream's tensors may be views of the model's
            # parameters (a weight buffer that is released or refilled after the save).
            self._pending.append((name, tensor.detach().to("cpu", copy=True)))
            self._pending_bytes += nbytes
            self._total += nbytes
            self._dtypes.add(tensor.dtype)

    def _flush(self) -> None:
        pending = self._pending
        # Numbered when the count is known (commit): model-00001-of-00003.safetensors.
        path = os.path.join(self._out.tmp, f"shard-{len(self._shards):05d}.safetensors")
        write_safetensors(path, [(n, tuple(t.shape), t.dtype) for n, t in pending],
                          [lambda: dict(pending)])
        self._shards.append([n for n, _ in pending])
        self._pending, self._pending_bytes = [], 0

    def commit(self, tokenizer=None) -> str:
        """Finish the directory; `tokenizer` (an HF tokenizer object) replaces meta_src's
        tokenizer files. Returns the directory."""
        try:
            if self._pending or not self._shards:
                self._flush()
            weight_map = {}
            for i, names in enumerate(self._shards):
                fname = f"model-{i + 1:05d}-of-{len(self._shards):05d}.safetensors"
                os.rename(os.path.join(self._out.tmp, f"shard-{i:05d}.safetensors"),
                          os.path.join(self._out.tmp, fname))
                weight_map.update({name: fname for name in names})
            with open(os.path.join(self._out.tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self._total}, "weight_map": weight_map}, f,
                          indent=2)
            copy_metadata_files(self.meta_src, self._out.tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(self._out.tmp)
            _set_config_dtype(os.path.join(self._out.tmp, "config.json"), self._dtypes)
        except BaseException:
            self.abort()
            raise
        return self._out.commit()

    def abort(self) -> None:
        self._out.abort()
