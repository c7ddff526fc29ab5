import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_readme_python_api_example_runs(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny"))
    run = subprocess.run([sys.executable, "examples/python_api.py", model], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all("pg_loss" in line for line in lines)
