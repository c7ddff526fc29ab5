"""scripts/setup.sh (run first by scripts/quickstart.sh and scripts/test.sh) picks the torch build
the machine needs and keeps what is installed; its --dry-run says what it would do. The real
runs from a fresh clone, twice, are README's commands (not repeated here: minutes each)."""
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(tmp_path, venv, gpu: bool) -> str:
    # A stand-in nvidia-smi shadows any real one: it lists a GPU or fails like a node without one.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n" if gpu
                    else "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               VERL_MCORE_VENV=str(venv))
    run = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_a_cpu_machine_gets_the_cpu_build(tmp_path):
    venv = tmp_path / "venv"
    out = _dry_run(tmp_path, venv, gpu=False)
    assert f"would run: python3 -m venv {venv}" in out
    assert "no NVIDIA GPU: installing the CPU build of torch (torch==2.13.0+cpu)" in out
    assert ("--index-url https://download.pytorch.org/whl/cpu" in out
            and "pip install torch\n" not in out)
    assert f"would run: {venv}/bin/python -m pip install -q -e {ROOT}[test]" in out
    assert not venv.exists()  # a dry run changes nothing


def test_a_gpu_machine_gets_the_default_cuda_build(tmp_path):
    out = _dry_run(tmp_path, tmp_path / "venv", gpu=True)
    assert "an NVIDIA GPU is present: installing the default (CUDA) build of torch" in out
    assert f"would run: {tmp_path}/venv/bin/python -m pip install torch\n" in out
    assert "+cpu" not in out


def test_an_installed_torch_is_kept_with_or_without_a_gpu(tmp_path):
    for gpu in (False, True):  # this test's own environment has torch
        out = _dry_run(tmp_path, sys.prefix, gpu=gpu)
        assert f"environment {sys.prefix} exists: reused" in out
        assert f"torch {torch.__version__} is installed: kept" in out
        assert "pip install torch" not in out and "-m venv" not in out


def test_a_gpu_machine_keeps_the_base_pythons_cuda_torch(tmp_path, monkeypatch):
    # A stand-in CUDA torch on the base Python's path (as an image or a site module provides).
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '2.11.0+cu130'\n"
                                      "class version:\n    cuda = '13.0'\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}{os.pathsep}"
                                     f"{os.environ.get('PYTHONPATH', '')}")
    out = _dry_run(tmp_path, tmp_path / "venv", gpu=True)
    assert (f"the base Python has a CUDA build of torch in {tmp_path / 'site'}: the environment "
            "reads it there") in out
    assert "the base Python's CUDA torch would be kept" in out and "pip install torch" not in out


def test_an_environment_whose_python_no_longer_runs_is_made_anew(tmp_path):
    # The base Python it was made from was upgraded or removed: bin/python dangles. A plain
    # `python -m venv` over it keeps the dangling link and the install then fails.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(tmp_path / "gone" / "python3.9")
    (venv / "pyvenv.cfg").write_text(f"home = {tmp_path}/gone\n")
    out = _dry_run(tmp_path, venv, gpu=False)
    assert f"environment {venv} is broken (its python does not run): made anew" in out
    assert f"would run: python3 -m venv --clear {venv}" in out


def test_an_environment_with_a_damaged_package_is_not_called_ready(tmp_path):
    # pip calls a damaged torch (its files partly gone) installed and skips it: the set-up must
    # say so and fail, not print "ready". The environment's python here sees a stand-in torch
    # that fails to import and a pip that installs nothing (as pip does for a damaged package).
    shims = tmp_path / "shims"
    (shims / "torch").mkdir(parents=True)
    (shims / "torch" / "__init__.py").write_text("raise ImportError('torch is damaged')\n")
    (shims / "pip").mkdir()
    (shims / "pip" / "__init__.py").write_text("")
    (shims / "pip" / "__main__.py").write_text("")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={shims} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               VERL_MCORE_VENV=str(venv))
    run = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "ready" not in run.stdout, run.stdout + run.stderr
    assert (f"setup: {venv} is set up but does not import: ImportError: torch is damaged\n"
            f"setup: a package there is damaged: remove the environment (rm -rf {venv})"
            in run.stderr), run.stderr
    assert not (venv / ".verl_mcore_installed").exists()  # the next run installs again
