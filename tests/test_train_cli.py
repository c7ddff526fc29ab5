"""The training command reports a config error before it loads torch and megatron-core
(seconds, with megatron's import-time warnings), and the error is the last line it prints."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_config_error_comes_before_torch_and_is_the_last_line():
    code = ("import sys\nfrom verl_mcore import train\n"
            "rc = train.main(['--config', 'configs/quickstart.yaml', 'actor.optim.lrr=1'])\n"
            "print('torch loaded:', 'torch' in sys.modules, 'exit', rc)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert run.stdout.strip() == "torch loaded: False exit 2", run.stdout + run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("config error:") and "lrr" in last, run.stderr
