"""Record the per-step metrics of the drift runs (runs.py) into tests/e2e/drift/<name>.json:

    python -m tests.e2e.drift.record                 # all four
    python -m tests.e2e.drift.record placed ppo      # some

Each config runs twice (in the same pooled ranks, as the tests run it); nothing is written unless
the two runs agree bit for bit in every compared metric (compare.py), since the tests compare
exactly. A recording names the commit it was made at (and whether the code had uncommitted
changes), the versions and CPU, and its config overrides with paths as placeholders.

When re-recording is legitimate: only for a change that is MEANT to alter what these runs
compute or report (a fixed bug in the loss, a new metric, another default, a new sampling
seed scheme, a changed e2e helper these runs reuse), with the reason in the commit message and
the diff of the JSON files reviewed: every changed number should be one the change explains.
Never to make a refactor pass: "Refactors keep numerics" (STYLE.md 15), and a refactor that moves
a metric has changed the program. A different torch / megatron-core / CPU can move last bits
without a code change (the failure message says when the environment differs); re-record then
only after checking that the code at the recorded commit gives the new numbers too.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.e2e.drift.compare import differences, environment, path_of, to_record
from tests.e2e.drift.runs import ROOT, RUNS, make_models

# The code a run's numbers come from (tests/ only chooses the configs, which are recorded).
CODE = ["verl_mcore", "configs", "examples", "tools"]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def record(name: str, root: Path) -> Path:
    """Run `name` twice under `root`, check the runs agree, write its recording."""
    run = RUNS[name]
    models = make_models(root / "models")
    first = run.launch(models, root / name / "first")
    second = run.launch(models, root / name / "second")
    steps = to_record(first)
    disagree = differences(name, steps, second)
    if disagree:
        raise SystemExit(f"run {name!r} is not reproducible run to run; nothing recorded:\n"
                         + "\n".join(disagree))
    out = {
        "run": name,
        "recorded": {"commit": _git("rev-parse", "HEAD"),
                     "code_changed": bool(_git("status", "--porcelain", "--", *CODE)),
                     "environment": environment()},
        "overrides": run.recorded_overrides(models, root / name / "first"),
        "steps": steps,
    }
    path = path_of(name)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.drift.record",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"runs to record (default: all): {', '.join(RUNS)}")
    names = parser.parse_args(argv).names or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"no run named {', '.join(unknown)}; the runs are {', '.join(RUNS)}")
    with tempfile.TemporaryDirectory(prefix="drift_record_") as tmp:
        for name in names:
            path = record(name, Path(tmp))
            print(f"recorded {name}: {path.relative_to(ROOT)}", flush=True)
    return 0


if __name__ == "__main__":  # the ranks are spawned: they import this module, not run it
    sys.exit(main())
