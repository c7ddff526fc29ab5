"""`pip install .` (a wheel, not editable) into a fresh venv: the console scripts work, no
top-level `tools` is installed, and the shipped quickstart trains through `verl-mcore-train`
from a directory outside the checkout."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, env, timeout=300):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin directory, env): the built wheel installed into a new venv that sees this
    interpreter's site-packages (torch, megatron-core: no downloads) but not the checkout."""
    tmp = tmp_path_factory.mktemp("pkg")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # The wheel is built from a copy of the tree: a stale build/ in the checkout (say one from
    # before tools/ stopped being installed) would otherwise go into the wheel.
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True, text=True).stdout
    src = tmp / "src"
    for rel in filter(None, files.split("\0")):
        if (ROOT / rel).is_file():  # a file deleted in the working tree is still "cached"
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((ROOT / rel).read_bytes())
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(tmp / "dist"), str(src)], tmp, {**env, "VERL_MCORE_NO_CUDA_EXT": "1"})
    (wheel,) = (tmp / "dist").glob("verl_mcore-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # `venv --system-site-packages` would expose the base interpreter's packages, not this
    # venv's; a plain path in a .pth adds them without running their .pth hooks (so an editable
    # install of the checkout there stays inactive). The venv's own site-packages comes first.
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "outer_site.pth").write_text("\n".join(sorted(ours)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
          "-q", str(wheel)], tmp, env)
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    return venv / "bin", env, cwd


@pytest.mark.slow
def test_the_wheel_installs_no_tools_and_its_scripts_run(installed):
    bin_dir, env, cwd = installed
    where = _run([str(bin_dir / "python"), "-c",
                  "import verl_mcore, importlib.util; print(verl_mcore.__file__); "
                  "print(importlib.util.find_spec('tools'))"], cwd, env)
    assert f"{bin_dir.parent}/lib/" in where and "None" in where  # the wheel's copy; no tools
    assert "--config" in _run([str(bin_dir / "verl-mcore-train"), "--help"], cwd, env)
    assert "hf-to-mcore" in _run([str(bin_dir / "verl-mcore-convert-hf"), "--help"], cwd, env)
    plan = _run([str(bin_dir / "verl-mcore-plan"), "--config", "quickstart"], cwd, env)
    assert "Model: runs/quickstart/tiny_model" in plan  # written by the plan on first use
    assert (cwd / "runs/quickstart/tiny_model/config.json").is_file()


@pytest.mark.slow
def test_the_shipped_quickstart_trains_a_step_from_another_directory(installed, tmp_path):
    bin_dir, env, _ = installed
    out = _run([str(bin_dir / "verl-mcore-train"), "--config", "quickstart", "trainer.total_steps=1",
                f"trainer.run_dir={tmp_path / 'run'}"], tmp_path, env, timeout=600)
    assert "model.make_tiny_if_missing: wrote the quickstart's tiny model" in out
    assert (tmp_path / "runs/quickstart/tiny_model/config.json").is_file()
    shipped = f"{bin_dir.parent}/lib/"  # the data were read from the wheel's shipped copies
    assert f"data train: 1 file ({shipped}" in out and "quickstart_train.parquet): " in out
    assert "16 prompts per step, " in out and "data val: 1 file" in out
    assert "run finished: 1 steps" in out
