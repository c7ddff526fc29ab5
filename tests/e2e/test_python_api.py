"""README's two Python examples as a user runs them: a plain `python examples/...` process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["python_api.py", "building_blocks.py"])
def test_readme_python_examples_run(tmp_path, script):
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny"))
    args = [model, str(tmp_path / "hf")] if script == "python_api.py" else [model]
    # This checkout's package, whatever `pip install -e` points at.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, f"examples/{script}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all("pg_loss" in line for line in lines)
    if script == "python_api.py":
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
