"""What a drift check compares, and how: the per-step metrics of a run against those recorded in
tests/e2e/drift/<run>.json (written by record.py).

Compared: every metric of every step (metrics.jsonl rows) except the run-dependent ones, whose
values change from one run of the same code to the next (`is_run_dependent`). Their names are
still compared, so a phase that disappears or a new one is noticed; only their values are not.

Tolerance: none. Two runs of each recorded config on the 2-core CPU machine are bit-identical in
every compared metric (checked when recording/choosing the rule: 1-rank pooled, 1-rank CLI with 1
and 2 torch threads, 4-rank pooled after other runs in the same ranks), because the CPU path is
deterministic: seeded sampling, fp32 reference ops, gloo reductions in a fixed order. So values
must be equal, not close; a refactor that reorders a sum shows up here, which is the point (a
reordering that only moves the last bit is still a change the lead should see and re-record
on purpose). record.py runs each config twice and refuses to record if the two differ.
"""
from __future__ import annotations

import importlib.metadata
import json
import platform
import re
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).resolve().parent

# Run-dependent metrics, from reading trainer.py, tracking.py, engine/actor.py, generation.py,
# rollout/native.py and distributed/placement.py:
#   time                    the JSONL row's wall clock (tracking.JsonlTracker)
#   timing_s/...            phase wall times (trainer.StageTimer), per role set when placed
#   memory_gb/..., memory/  CUDA allocator peaks and retries (StageTimer; absent on CPU)
#   perf/...                tokens/s, max RSS / allocated GB, MFU, per-set utilisation (busy /
#                           step time), offloaded GB
#   .../tokens_per_s, .../mfu   the actor's and critic's update over its wall time
#   ...seconds              rollout/repartition_seconds, rollout/transfer_seconds
#   ..._gb, rss, utilisation    memory the engine keeps (rollout/kept_cache_gb) and the like
RUN_DEPENDENT = re.compile(r"^(time|timing_s/.*|memory_gb/.*|memory/.*|perf/.*)$"
                           r"|(tokens_per_s|/mfu|seconds|_gb|rss|utilisation)$")


def is_run_dependent(key: str) -> bool:
    """Whether `key`'s value varies from run to run of the same code (timing, memory, speed)."""
    return bool(RUN_DEPENDENT.search(key))


def split(row: dict) -> tuple[dict, list[str]]:
    """A metrics.jsonl row -> (the compared metrics {key: value}, the run-dependent keys)."""
    compared = {k: v for k, v in row.items() if k != "step" and not is_run_dependent(k)}
    return compared, sorted(k for k in row if is_run_dependent(k))


def to_record(rows: list[dict]) -> list[dict]:
    """The `steps` of a recording: [{"step", "metrics", "run_dependent"}] per metrics row."""
    out = []
    for row in rows:
        compared, run_dependent = split(row)
        out.append({"step": row["step"], "metrics": dict(sorted(compared.items())),
                    "run_dependent": run_dependent})
    return out


def environment() -> dict:
    """What produced the numbers besides the code: a different torch or CPU may move last bits."""
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo()
                if line.startswith("model name")), platform.processor())
    version = importlib.metadata.version
    return {"torch": torch.__version__, "megatron-core": version("megatron-core"),
            "numpy": version("numpy"), "python": platform.python_version(), "cpu": cpu}


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def path_of(run: str) -> Path:
    return HERE / f"{run}.json"


def load(run: str) -> dict:
    path = path_of(run)
    if not path.exists():
        raise AssertionError(f"run {run!r}: no recording at {path}; write it with "
                             f"`python -m tests.e2e.drift.record {run}`")
    return json.loads(path.read_text())


def differences(run: str, recorded_steps: list[dict], rows: list[dict]) -> list[str]:
    """Every way `rows` (a run's metrics.jsonl) differ from `recorded_steps`, one line each
    naming the run, the step, the key and both values; [] when they are equal."""
    out = []
    want = {s["step"]: s for s in recorded_steps}
    got = {r["step"]: r for r in rows}
    if sorted(want) != sorted(got):
        out.append(f"run {run!r}: steps recorded {sorted(want)}, got {sorted(got)}")
    for step in sorted(set(want) & set(got)):
        rec, (metrics, run_dependent) = want[step], split(got[step])
        for key in sorted(set(rec["metrics"]) - set(metrics)):
            out.append(f"run {run!r} step {step}: {key!r} recorded ({rec['metrics'][key]!r}) "
                       f"but missing")
        for key in sorted(set(metrics) - set(rec["metrics"])):
            out.append(f"run {run!r} step {step}: new key {key!r} (got {metrics[key]!r}), "
                       f"not in the recording")
        for key in sorted(set(rec["run_dependent"]) ^ set(run_dependent)):
            state = "missing" if key in rec["run_dependent"] else "new, not in the recording"
            out.append(f"run {run!r} step {step}: run-dependent key {key!r} (value not compared) "
                       f"{state}")
        for key in sorted(set(rec["metrics"]) & set(metrics)):
            a, b = rec["metrics"][key], metrics[key]
            if a != b:  # exact: see the module docstring
                out.append(f"run {run!r} step {step} {key!r}: recorded {a!r}, got {b!r}"
                           f"{_relative(a, b)}")
    return out


def _relative(a, b) -> str:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a != 0:
        return f" (relative difference {abs(b - a) / abs(a):.3g})"
    return ""


def assert_no_drift(run: str, rows: list[dict], overrides: Optional[list[str]] = None) -> None:
    """Fail unless `rows` equal the recording of `run`; with `overrides` (the run's, paths
    replaced as Run.recorded_overrides does) first check that the recording is of this config."""
    recorded = load(run)
    how = (f"Recorded at commit {recorded['recorded']['commit']}"
           f"{' with uncommitted code changes' if recorded['recorded']['code_changed'] else ''}; "
           f"re-record with `python -m tests.e2e.drift.record {run}` only when the change is "
           f"meant to alter these numbers (record.py says when).")
    if overrides is not None and overrides != recorded["overrides"]:
        changed = [f"  - {o}" for o in recorded["overrides"] if o not in overrides]
        changed += [f"  + {o}" for o in overrides if o not in recorded["overrides"]]
        raise AssertionError(
            f"run {run!r}: the config is not the one recorded (an e2e helper this run reuses "
            f"changed?), so its metrics cannot be compared:\n" + "\n".join(changed or
            ["  (same overrides in another order)"]) + f"\n{how}")
    lines = differences(run, recorded["steps"], rows)
    if not lines:
        return
    env = environment()
    other = {k: (v, env.get(k)) for k, v in recorded["recorded"]["environment"].items()
             if env.get(k) != v}
    note = (f"\nThe environment differs from the recording's ({other}: recorded, now): the last "
            f"bits may move without a code change." if other else "")
    shown = lines[:30] + ([f"... and {len(lines) - 30} more"] if len(lines) > 30 else [])
    raise AssertionError(f"run {run!r}: {len(lines)} difference(s) from the recorded metrics:\n"
                         + "\n".join(shown) + f"\n{how}{note}")
