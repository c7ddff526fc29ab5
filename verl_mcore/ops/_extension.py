"""Finding the CUDA extension (csrc/), once per process.

`VERL_MCORE_OPS` chooses:
  auto       (default) use the prebuilt `verl_mcore._C` (setup.py builds it when a CUDA toolkit and
             a CUDA build of torch are present); without it, the torch reference.
  jit        build csrc/ now with torch.utils.cpp_extension.load (development; needs nvcc and a
             CUDA build of torch; cached under torch's extension directory).
  reference  never use the extension.
`extension()` returns the module or None; `extension_status()` says which and why.
"""
from __future__ import annotations

import functools
import glob
import os
from types import ModuleType
from typing import Optional

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Optional[ModuleType], str]:
    mode = os.environ.get("VERL_MCORE_OPS", "auto")
    if mode == "reference":
        return None, "VERL_MCORE_OPS=reference"
    if mode == "jit":
        from torch.utils.cpp_extension import load

        sources = sorted(glob.glob(os.path.join(_CSRC, "*.cu")) + glob.glob(os.path.join(_CSRC, "*.cpp")))
        if not sources:
            raise RuntimeError(f"VERL_MCORE_OPS=jit: no CUDA sources found in {_CSRC} (is this a source checkout?)")
        module = load(
            name="verl_mcore_C_jit",
            sources=sources,
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"],
            verbose=os.environ.get("VERL_MCORE_JIT_VERBOSE") == "1",
        )
        return module, f"JIT build of {_CSRC}"
    if mode != "auto":
        raise ValueError(f"VERL_MCORE_OPS={mode!r}: expected one of auto, jit, reference")
    try:
        # Optional: the compiled CUDA extension, built by setup.py only where CUDA is.
        from verl_mcore import _C  # type: ignore[attr-defined]
    except ImportError as e:
        return None, f"verl_mcore._C not importable ({e}); using the torch reference"
    return _C, "prebuilt verl_mcore._C"


def extension() -> Optional[ModuleType]:
    return _load()[0]


def extension_status() -> str:
    return _load()[1]
