"""verl_mcore: RL post-training (PPO, GRPO, ...) on megatron-core as an HPC batch system.

The CUDA extension (csrc/) is built only when both a CUDA toolkit and a CUDA build of torch are
present; otherwise the package installs pure-Python and `verl_mcore.ops` uses its torch reference.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# Files outside the package that an installed verl_mcore needs: every config, and what the
# quickstart reads (its data and reward). They are copied into verl_mcore/_shipped/, where
# verl_mcore/shipped.py finds them (`verl-mcore-train --config quickstart` from any directory).
SHIPPED = ["configs/*.yaml", "examples/data/quickstart_*.parquet", "examples/quickstart_reward.py"]

CORE = [
    "torch>=2.6",
    "megatron-core==0.16.1",
    "pyarrow>=14",
    "pyyaml>=6",
    "numpy>=1.24",
    "transformers>=4.45",
    "safetensors>=0.4",
    "tqdm>=4.60",
    # megatron-core's dist_checkpointing imports psutil without declaring it.
    "psutil>=5.9",
]
EXTRAS = {
    "gpu": ["vllm", "transformer-engine[pytorch]", "flash-attn"],
    "mpi": ["mpi4py>=3.1"],
    "track": ["tensorboard", "wandb"],
    # math-verify: reward.math_compat=math_verify (reward/mathverify.py); pure Python.
    "math": ["math-verify>=0.9"],
    # bm25s: the agent search tool's BM25 ranking (examples/agent/search_tool.py); numpy only.
    "agent": ["bm25s>=0.2"],
    # pandas and datasets: the frames verl-style dataset classes build (tests/data/test_verl_dataset.py).
    "test": ["pytest>=7", "hypothesis>=6", "matplotlib>=3.7", "pandas>=2", "datasets>=3",
             "rouge-score>=0.1.2", "sacrebleu>=2.0",
             # peft: the oracle of the LoRA tests, and what loads an exported adapter.
             "peft>=0.13",
             # gguf: transformers reads the real-model fixture's GGUF file with it
             # (verl_mcore/real_model.py).
             "gguf>=0.10",
             # math-verify: the math_verify backend's tests (tests/reward/test_verl_parity.py).
             "math-verify>=0.9",
             # import-linter: the package's layer contracts (pyproject.toml, tests/test_layers.py).
             "import-linter>=2.16",
             # bm25s: the agent search tool example's tests (tests/agent/test_examples.py).
             "bm25s>=0.2"],
}


def cuda_extensions():
    """The csrc/ extension, or [] with one clear message when CUDA is not available."""
    if os.environ.get("VERL_MCORE_NO_CUDA_EXT") == "1":
        print("verl_mcore: VERL_MCORE_NO_CUDA_EXT=1, not building the CUDA extension")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("verl_mcore: torch not importable at build time; CUDA extension skipped")
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        print("verl_mcore: no CUDA build of torch or no CUDA toolkit; CUDA extension skipped "
              "(verl_mcore.ops falls back to its torch reference)")
        return [], {}
    sources = sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith((".cu", ".cpp")))
    if not sources:
        return [], {}
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    ext = CUDAExtension(
        name="verl_mcore._C",
        sources=sources,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]},
    )
    return [ext], {"build_ext": BuildExtension}


class BuildPyWithShipped(build_py):
    """build_py, plus SHIPPED copied into the built package under verl_mcore/_shipped/."""

    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        for pattern in SHIPPED:
            files = sorted(glob.glob(os.path.join(here, pattern)))
            if not files:  # a renamed example must not silently ship a broken quickstart
                raise RuntimeError(f"setup.py SHIPPED: {pattern} matches no file")
            for src in files:
                dst = os.path.join(self.build_lib, "verl_mcore", "_shipped", os.path.relpath(src, here))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(src, dst)


ext_modules, cmdclass = cuda_extensions()
cmdclass = {**cmdclass, "build_py": BuildPyWithShipped}

setup(
    name="verl_mcore",
    version="0.1.0",
    description="RL post-training for LLMs on megatron-core, launched by Slurm/torchrun/mpirun",
    # tools/ stays a checkout-only package (`python -m tools...`): an installed top-level `tools`
    # would clash with anything else of that name. What the package needs from it lives in
    # verl_mcore (tiny_model, convert_hf) and tools/ re-exports it.
    packages=find_packages(include=["verl_mcore", "verl_mcore.*"]),
    entry_points={"console_scripts": [
        "verl-mcore-train = verl_mcore.train:main",
        "verl-mcore-plan = verl_mcore.plan:main",
        "verl-mcore-convert-hf = verl_mcore.convert_hf.__main__:main",
    ]},
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require=EXTRAS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    include_package_data=True,
)
