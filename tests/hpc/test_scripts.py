"""The sbatch scripts without Slurm: shellcheck, --dry-run, argument pass-through, exit codes."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from verl_mcore.distributed.preemption import EXIT_PREEMPTED
from verl_mcore.distributed.watchdog import EXIT_COLLECTIVE_TIMEOUT

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = (sorted((ROOT / "scripts" / "slurm").glob("*.sh")) + sorted((ROOT / "tests" / "hpc").glob("*.sh"))
           # the set-up commands (scripts/setup.sh under quickstart.sh and test.sh) and CI's
           + sorted((ROOT / "scripts").glob("*.sh")) + [ROOT / ".ci" / "run"])


def _run(*args, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(["bash", *map(str, args)], cwd="/", env=clean | env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (apt-get install -y shellcheck)")
def test_scripts_pass_shellcheck():
    out = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_recipes_have_the_expected_sbatch_header():
    for name in ("ppo_70b.sh", "ppo_7b.sh", "grpo_7b.sh"):
        text = (ROOT / "scripts" / "slurm" / name).read_text()
        for option in ("nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time"):
            assert re.search(rf"^#SBATCH --{option}=\S+", text, re.M), (name, option)
        assert re.search(r"^#SBATCH --output=\S*%j", text, re.M)
        assert re.search(r"^#SBATCH --signal=B:USR1@\d+$", text, re.M)
        assert re.search(r"^#SBATCH --requeue$", text, re.M)


def test_launcher_exit_codes_match_python():
    text = (ROOT / "scripts" / "slurm" / "launch.sh").read_text()
    assert f"readonly EXIT_PREEMPTED={EXIT_PREEMPTED}\n" in text
    assert f"readonly EXIT_COLLECTIVE_TIMEOUT={EXIT_COLLECTIVE_TIMEOUT}\n" in text


def test_70b_dry_run_prints_layout_without_slurm():
    out = _run(ROOT / "scripts/slurm/ppo_70b.sh", "--dry-run", "trainer.total_steps=3")
    assert out.returncode == 0, out.stderr
    assert "Layout: 64 ranks = 8 node(s) × 8 GPU(s); training TP=8 × PP=4 × CP=1 × DP=2" in out.stdout
    assert "node7: ranks [56-63]" in out.stdout
    assert ("would run: srun --ntasks=64 --ntasks-per-node=8 --kill-on-bad-exit=1" in out.stderr
            and "-m verl_mcore.train --config configs/ppo_llama3_70b.yaml trainer.total_steps=3"
            in out.stderr)


def test_dry_run_refuses_a_layout_that_does_not_fit():
    out = _run(ROOT / "scripts/slurm/ppo_70b.sh", "--dry-run", "parallel.pipeline_model_parallel_size=1",
               PLAN_GPU_MEMORY_GB="80")
    assert out.returncode == 3
    assert "parallel.pipeline_model_parallel_size=2" in out.stderr
    assert "nothing was launched" in out.stderr and "would run" not in out.stderr


def test_config_argument_and_torchrun_variant():
    out = _run(ROOT / "scripts/slurm/grpo_7b.sh", "configs/ppo_7b.yaml", "--dry-run",
               VERL_MCORE_LAUNCHER="torchrun", VERL_MCORE_MODULE="tests.hpc.fake_train")
    assert out.returncode == 0, out.stderr
    assert "config configs/ppo_7b.yaml; 1 node(s) × 8 rank(s)" in out.stderr
    assert ("srun --ntasks=1 --ntasks-per-node=1 --kill-on-bad-exit=1" in out.stderr
            and "torch.distributed.run --nnodes=1 --nproc-per-node=8" in out.stderr
            and "-m tests.hpc.fake_train --config configs/ppo_7b.yaml" in out.stderr)
    bad = _run(ROOT / "scripts/slurm/grpo_7b.sh", "--dry-run", "oops")
    assert bad.returncode == 2 and "unexpected argument 'oops'" in bad.stderr
