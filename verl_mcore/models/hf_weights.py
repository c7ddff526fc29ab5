"""Read Hugging Face safetensors one tensor (or one slice) at a time, and load them into a GPTModel.

`load_hf_weights(model, arch, hf_dir, role)` fills this rank's TP/PP slice of a model built by
`build_gpt_model` straight from the HF files: each parameter reads only its own rows/columns
(safetensors `get_slice`), so no rank ever holds the whole model, and host memory stays near
one layer's slice.
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Iterable, Sequence

import torch
from safetensors import safe_open

from verl_mcore.errors import ConfigError
from verl_mcore.models import weight_map as wm
from verl_mcore.models.hf_config import HFArch
from verl_mcore.models.hub import cache_advice


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_source(hf_dir: str) -> tuple[str, str]:
    """("single", path) or ("index", path): the weights transformers' from_pretrained would load
    from `hf_dir`. model.safetensors wins over an index, as there: save_pretrained into a folder
    that held a sharded save leaves the old index behind next to the new single file. Raises
    FileNotFoundError when there is neither."""
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return "single", single
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index):
        return "index", index
    raise FileNotFoundError(f"{hf_dir}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors are supported)")


class HFCheckpoint:
    """The tensors of an HF model directory (model.safetensors or a sharded index)."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.hf_dir = os.fspath(hf_dir)
        kind, path = weight_source(self.hf_dir)
        if kind == "index":
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
            self.files = {name: os.path.join(self.hf_dir, fn) for name, fn in weight_map.items()}
        else:
            with safe_open(path, "pt") as f:
                self.files = {name: path for name in f.keys()}
        self._headers: dict[str, tuple[list[int], torch.dtype]] | None = None

    def names(self) -> list[str]:
        return list(self.files)

    def _file(self, name: str) -> str:
        if name not in self.files:
            raise KeyError(f"{self.hf_dir}: tensor {name!r} is not in the checkpoint")
        return self.files[name]

    def shape_dtype(self, name: str) -> tuple[list[int], torch.dtype]:
        """Shape and dtype from the safetensors headers (reads no tensor data)."""
        path = self._file(name)
        if self._headers is None:
            self._headers = {}
            for shard in sorted(set(self.files.values())):
                with safe_open(shard, "pt") as f:
                    for key in f.keys():
                        sl = f.get_slice(key)
                        self._headers[key] = (list(sl.get_shape()), sl.get_dtype())
        if name not in self._headers:
            raise KeyError(f"{path}: tensor {name!r} is listed in the index but not in the file")
        shape, dtype_name = self._headers[name]
        return shape, _weight_dtype(dtype_name, name, path)

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int = -1) -> torch.Tensor:
        """Tensor `name`, or its [start, stop) range along `dim` (stop -1: to the end).

        The file is opened per call so its memory map is released right after: host RSS stays
        at the tensors actually held, not the pages of every shard touched so far.
        """
        self.shape_dtype(name)  # a quantised tensor fails here, by name, not as a silent cast
        with safe_open(self._file(name), "pt") as f:
            if start == 0 and stop == -1:
                return f.get_tensor(name)
            sl = f.get_slice(name)
            index = (slice(None),) * dim + (slice(start, None if stop == -1 else stop),)
            return sl[index]


def check_tensors(ckpt: HFCheckpoint, arch: HFArch, role: str = "actor") -> list[str]:
    """Every tensor the model reads is in the checkpoint with the shape config.json implies and a
    float dtype, from the safetensors headers alone (before any model is built or anything is
    written): a config that does not describe its weights fails here, naming the tensor, its file
    and both shapes, not at load time or never (a norm of 65 for hidden 64 once converted with
    exit 0). Returns the checkpoint's tensors that nothing reads (transformers warns of those
    too: a stale extra layer, a bias the architecture has no place for)."""
    expected = wm.hf_shapes(arch, role)
    wrong = []
    for name, shape in expected.items():
        found, _ = ckpt.shape_dtype(name)  # names a missing tensor or a quantised dtype
        if tuple(found) != shape:
            wrong.append(f"{name!r} in {ckpt._file(name)} is {list(found)}, config.json implies "
                         f"{list(shape)}")
    if wrong:
        raise ConfigError(f"{ckpt.hf_dir}: {len(wrong)} tensors do not match config.json: "
                          + "; ".join(wrong[:4]) + (" ..." if len(wrong) > 4 else ""))
    read = set(expected) | ({"lm_head.weight"} if arch.tie_embeddings else set())  # tied: ignored
    return sorted(set(ckpt.names()) - read)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def check_weight_files(hf_dir: str | os.PathLike, key: str = "model.path") -> set:
    """Every safetensors file of an HF directory complete and consistent, from its header alone
    (reads no tensor data): a truncated download or a cut copy fails here naming the file and
    what is missing, before any model is built, instead of safetensors' `incomplete metadata`
    without a file name minutes later. Raises ConfigError naming `key`, the config key that
    names the directory. Returns the names of the tensors the files hold."""
    hf_dir = os.fspath(hf_dir)
    try:
        kind, index = weight_source(hf_dir)
    except FileNotFoundError:
        raise ConfigError(f"{key}={hf_dir}: no model.safetensors or "
                          "model.safetensors.index.json (only safetensors are supported; or give "
                          f"the weights as a dist checkpoint in model.checkpoint){cache_advice(hf_dir)}") from None
    if kind == "index":
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            listed: dict[str, set] = {}
            for name, file in weight_map.items():
                listed.setdefault(file, set()).add(name)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); "
                              f"repair or re-download it ({key}){cache_advice(index)}") from None
    else:
        listed = {SINGLE_FILE: set()}
    names_found: set = set()
    for file, names in sorted(listed.items()):
        path = os.path.join(hf_dir, file)
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: listed in {index} but missing: the download or copy is "
                              f"incomplete ({key}){cache_advice(path)}")
        found = _check_safetensors_header(path, key)
        names_found |= found
        missing = names - found
        if missing:
            raise ConfigError(f"{path}: {len(missing)} tensors listed in {index} are not in the "
                              f"file, e.g. {sorted(missing)[0]!r} ({key}){cache_advice(path)}")
    return names_found


def _check_safetensors_header(path: str, key: str = "model.path") -> set:
    """The tensor names of one safetensors file whose header is whole, parses, and describes
    tensors that fit the file exactly; raises ConfigError naming the file otherwise."""
    def damaged(detail: str) -> ConfigError:
        return ConfigError(f"{path}: the safetensors file is incomplete or damaged: {detail}; "
                           f"re-download or re-convert it ({key}){cache_advice(path)}")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise damaged(f"{size} bytes, too short for a header")
        n = struct.unpack("<Q", head)[0]
        if 8 + n > size:
            raise damaged(f"its header is {n} bytes but only {size - 8} follow")
        try:
            header = json.loads(f.read(n))
            tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            spans = [(k, *(int(o) for o in v["data_offsets"]), v["dtype"], v["shape"])
                     for k, v in tensors.items()]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise damaged(f"its header does not parse ({type(e).__name__}: {e})") from None
    data = size - 8 - n
    for name, begin, end, dtype, shape in spans:
        expected = math.prod(shape) * _DTYPE_BYTES.get(dtype, 0)
        if not 0 <= begin <= end or (dtype in _DTYPE_BYTES and end - begin != expected):
            raise damaged(f"tensor {name!r} has offsets [{begin}, {end}) for {dtype} {shape}")
        if end > data:
            raise damaged(f"tensor {name!r} ends at byte {end} of the data, which has {data} "
                          "bytes (the file is cut short)")
    end = max((s[2] for s in spans), default=0)
    if end != data:
        raise damaged(f"the tensors cover {end} bytes of its {data} data bytes")
    return set(tensors)


# The weight dtypes a model can be built from (each is cast to the model's dtype). Integer and
# FP8 tensors are a quantised checkpoint, whose scales we do not read: cast to bf16 they would be
# silently wrong, so they are refused by name.
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "F64": torch.float64}


def _weight_dtype(name: str, tensor: str, path: str) -> torch.dtype:
    if name not in _SAFETENSORS_DTYPES:
        raise ConfigError(f"{path}: tensor {tensor!r} is {name}: a quantised checkpoint (integer "
                          f"or FP8 weights) is not supported; give the unquantised model "
                          f"(F32, BF16, F16 or F64 weights)")
    return _SAFETENSORS_DTYPES[name]


def _tp_info(model) -> tuple[int, int]:
    tp_group = model.pg_collection.tp
    return tp_group.rank(), tp_group.size()


def expert_layout(model) -> tuple[int, int, int]:
    """(first global expert of this rank, expert-TP rank, expert-TP size) of a GPTModel stage:
    its routed experts are `expert_range(E, ep_rank, ep_size)`, and each expert's fc1 / fc2 are
    sliced over the expert TP group. (0, TP rank, TP size) for a dense model."""
    config = model.config
    if not config.num_moe_experts:
        return (0, *_tp_info(model))
    ep, etp = model.pg_collection.ep, model.pg_collection.expt_tp
    first = wm.expert_range(config.num_moe_experts, ep.rank(), ep.size())[0]
    return first, etp.rank(), etp.size()


def named_canonical_parameters(model) -> Iterable[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter) for a GPTModel stage: global layer indices, TE spelling,
    global expert indices."""
    first_expert = expert_layout(model)[0]
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            local = int(name.split(".")[2])
            layer_number = model.decoder.layers[local].layer_number  # 1-based, global
            yield wm.canonical_name(name, layer_number - 1, first_expert), param
        else:
            yield name, param


def load_hf_weights(model, arch: HFArch, hf_dir: str | os.PathLike, role: str = "actor",
                    skip: Sequence[str] = ()) -> list[str]:
    """Copy this rank's slice of the HF weights into `model`; returns the canonical names loaded.

    A critic's value head has no HF source and keeps its fresh initialisation; so does any
    canonical name in `skip`. Any other parameter without an HF source is an error.
    """
    ckpt = HFCheckpoint(hf_dir)
    maps = {pm.mcore: pm for pm in wm.param_maps(arch, role)}
    embedding = maps["embedding.word_embeddings.weight"]
    tp_rank, tp_size = _tp_info(model)
    _, etp_rank, etp_size = expert_layout(model)
    padded = model.vocab_size
    loaded = []
    with torch.no_grad():
        for name, param in named_canonical_parameters(model):
            if name in skip or (name == "output_layer.weight" and role == "critic"):
                continue
            pm = maps.get(name)
            if pm is None and name == "output_layer.weight" and arch.tie_embeddings:
                pm = embedding  # the last stage's copy of the tied embedding (PP > 1)
            if pm is None:
                raise KeyError(f"load_hf_weights: no HF source for parameter {name!r} "
                               f"(role {role}, model_type {arch.model_type}, {hf_dir})")
            # A routed expert's weights are sliced over the expert TP group.
            rank, size = (etp_rank, etp_size) if pm.expert is not None else (tp_rank, tp_size)
            parts = [ckpt.read(hf_name, dim, start, stop).to(param.dtype)
                     for hf_name, dim, start, stop in wm.hf_read_slices(pm, arch, rank, size,
                                                                         padded)]
            local = wm.build_tp_local(pm, arch, parts, size, padded)
            if local.shape != param.shape:
                raise ValueError(f"load_hf_weights: {name!r} on TP rank {tp_rank}: HF gives "
                                 f"{tuple(local.shape)}, the model has {tuple(param.shape)}")
            param.copy_(local)
            loaded.append(name)
    return loaded
