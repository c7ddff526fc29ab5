"""The package's layers (pyproject.toml [tool.importlinter]) hold, and the check can fail.

`lint-imports` reads every import statement of the package, function-level ones included, and
checks the contracts: the layers (entries > loop > workflows > mechanisms > foundations), no
import loop between modules, distributed/ not importing the trainer, config/ not importing the
planner's CLI. The planted tests copy the package, add one forbidden import inside a function and
expect the same contracts to fail naming it.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Beside this interpreter (a venv's bin/), else on PATH. A test requirement (setup.py's `test`
# extra): missing, the tests fail rather than skip, so CI cannot pass without the check.
LINT = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports with the repository's contracts, on the package under `root`."""
    if LINT is None:
        pytest.fail("lint-imports not found: pip install -e '.[test]' (import-linter)")
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([LINT, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "verl_mcore", tmp_path / "verl_mcore",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_shipped"))
    return tmp_path


def _plant(path: Path, line: str) -> None:
    """Append a function holding `line` (an import) to `path`."""
    with open(path, "a") as f:
        f.write(f"\n\ndef _planted():\n    {line}\n")


def test_the_contracts_hold():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "4 kept, 0 broken" in run.stdout


@pytest.mark.parametrize("module, line, broken", [
    # a lower layer importing the trainer, inside a function
    ("distributed/groups.py", "from verl_mcore import trainer",
     ["distributed/ does not import the trainer BROKEN",
      "verl_mcore.distributed.groups -> verl_mcore.trainer",
      "verl_mcore layers: entries > loop > workflows > mechanisms > foundations BROKEN"]),
    # ops -> algo beside algo.advantages -> ops: a loop inside the foundations
    ("ops/gae.py", "from verl_mcore.algo import advantages",
     ["no import loop between the package's modules (siblings acyclic at every depth) BROKEN",
      ".ops -> .algo"]),
    ("config/validate.py", "from verl_mcore import plan",
     ["config/ does not import the planner's CLI BROKEN"]),
], ids=["distributed-imports-trainer", "loop-ops-algo", "config-imports-planner-cli"])
def test_a_planted_import_fails_the_check(tmp_path, module, line, broken):
    """A copy of the package with one forbidden import added inside a function: lint-imports
    fails and names it."""
    root = _copy(tmp_path)
    _plant(root / "verl_mcore" / module, line)
    run = _lint(root)
    assert run.returncode != 0, run.stdout[-4000:]
    for text in broken:
        assert text in run.stdout, run.stdout[-4000:]


# The package's own modules imported inside a function, each for a reason its comment gives:
# something optional, or a lazy package attribute that keeps an import light.
FUNCTION_LEVEL = {
    ("verl_mcore/__init__.py", "verl_mcore"),  # `from verl_mcore import api`: the lazy API names
    ("verl_mcore/ops/_extension.py", "verl_mcore"),  # `_C`: the optional compiled extension
    ("verl_mcore/ops/triton_paged.py", "verl_mcore.ops"),  # the Triton kernels (triton optional)
    ("verl_mcore/ops/fp8.py", "verl_mcore.ops"),  # the Triton FP8 quantization (triton optional)
    ("verl_mcore/reward/__init__.py", "verl_mcore.reward.placement"),  # torch-free workers
    ("verl_mcore/train.py", "verl_mcore.job"),  # a config error before torch and megatron load
}


def _function_level_imports() -> set[tuple[str, str, bool]]:
    """(file, module, commented) of every import of verl_mcore.* inside a function; commented:
    a comment on its line or the two above."""
    found = set()
    for path in sorted((ROOT / "verl_mcore").rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verl_mcore"):
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names if a.name.startswith("verl_mcore")]
                else:
                    continue
                commented = any("#" in line for line in lines[node.lineno - 3:node.lineno])
                found |= {(str(path.relative_to(ROOT)), name, commented) for name in names}
    return found


def test_the_package_imports_its_modules_at_the_top():
    """Between the package's modules an import sits at a module's top; the few inside a
    function are listed above and say why in a comment (import-linter checks where imports
    go, not where they sit)."""
    found = _function_level_imports()
    assert {(f, m) for f, m, _ in found} == FUNCTION_LEVEL
    assert all(commented for _, _, commented in found), sorted(found)


def test_config_and_the_scoring_workers_stay_free_of_torch():
    """Every spawned scoring worker imports the reward package, which reads the config: moving
    an import to a module's top must not make them import torch (seconds per worker)."""
    code = ("import sys, verl_mcore.config, verl_mcore.reward.worker, verl_mcore.user_code; "
            "print(sorted(m for m in ('torch', 'megatron.core', 'transformers') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
