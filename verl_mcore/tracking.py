"""Metrics: reduced correctly across ranks, then written by trackers (console, JSONL, TB, wandb).

Reduction. Every rank accumulates, per metric name, what it saw: a sum and a count for means
(`add_mean`, weighted by how many tokens / samples / items the value covers), or a running
max / min (`add_max`, `add_min`). `MetricAccumulator.reduce(group)` packs them into one tensor
and does three all-reduces (SUM for sums and counts, MAX, MIN), so `critic/score/mean` is the
mean over every sample of the step on every rank, not a mean of per-rank means. Every rank must
record the same metric names (they run the same program on their shard); names are checked.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from verl_mcore.utils.files import disk_full_error, is_disk_full, write_text_atomic

log = logging.getLogger("verl_mcore.tracking")


class MetricAccumulator:
    def __init__(self):
        self._sum: dict[str, float] = {}
        self._count: dict[str, float] = {}
        self._max: dict[str, float] = {}
        self._min: dict[str, float] = {}

    def add_mean(self, name: str, value, weight: float = 1.0) -> None:
        """Add `value` (a float, or a tensor/list whose elements are averaged) with `weight`.

        For a tensor, pass `mask` semantics by selecting first: the mean is over its elements.
        """
        if isinstance(value, torch.Tensor):
            value = value.detach().double()
            n = value.numel()
            if n == 0:
                self._sum.setdefault(name, 0.0)
                self._count.setdefault(name, 0.0)
                return
            total, weight = float(value.sum()), float(n)
        elif isinstance(value, (list, tuple)):
            if not value:
                self._sum.setdefault(name, 0.0)
                self._count.setdefault(name, 0.0)
                return
            total, weight = float(sum(value)), float(len(value))
        else:
            total = float(value) * weight
        self._sum[name] = self._sum.get(name, 0.0) + total
        self._count[name] = self._count.get(name, 0.0) + weight

    def add_max(self, name: str, value) -> None:
        v = float(value.max()) if isinstance(value, torch.Tensor) and value.numel() else (
            float("-inf") if isinstance(value, torch.Tensor) else float(value))
        self._max[name] = max(self._max.get(name, float("-inf")), v)

    def add_min(self, name: str, value) -> None:
        v = float(value.min()) if isinstance(value, torch.Tensor) and value.numel() else (
            float("inf") if isinstance(value, torch.Tensor) else float(value))
        self._min[name] = min(self._min.get(name, float("inf")), v)

    def add_stats(self, prefix: str, values: torch.Tensor) -> None:
        """`prefix/mean`, `prefix/max`, `prefix/min` of a set of values."""
        self.add_mean(f"{prefix}/mean", values)
        self.add_max(f"{prefix}/max", values)
        self.add_min(f"{prefix}/min", values)

    def set(self, name: str, value: float) -> None:
        """A value already identical on every rank (lr, a timing measured on rank 0, ...)."""
        self._sum[name] = float(value)
        self._count[name] = 1.0

    def reduce(self, group=None) -> dict[str, float]:
        means, maxes, mins = sorted(self._sum), sorted(self._max), sorted(self._min)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            names = [None] * dist.get_world_size(group)
            dist.all_gather_object(names, (means, maxes, mins), group=group)
            if any(n != names[0] for n in names):
                mismatch = {i: n for i, n in enumerate(names) if n != names[0]}
                raise RuntimeError(f"metrics differ across ranks: rank 0 has {names[0]}, "
                                   f"others {mismatch}")
            sums = torch.tensor([self._sum[n] for n in means] + [self._count[n] for n in means],
                                dtype=torch.float64)
            mx = torch.tensor([self._max[n] for n in maxes], dtype=torch.float64)
            mn = torch.tensor([self._min[n] for n in mins], dtype=torch.float64)
            for t, op in ((sums, dist.ReduceOp.SUM), (mx, dist.ReduceOp.MAX), (mn, dist.ReduceOp.MIN)):
                if t.numel():
                    dist.all_reduce(t, op=op, group=group)
            k = len(means)
            totals, counts = sums[:k].tolist(), sums[k:].tolist()
            out = {n: (s / c if c else float("nan")) for n, s, c in zip(means, totals, counts)}
            out.update(zip(maxes, mx.tolist()))
            out.update(zip(mins, mn.tolist()))
        else:
            out = {n: (self._sum[n] / self._count[n] if self._count[n] else float("nan")) for n in means}
            out.update(self._max)
            out.update(self._min)
        return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------
# Trackers (rank 0 only)

class JsonlTracker:
    """Always on: one JSON object per step in RUN_DIR/metrics.jsonl, flushed every step.
    Append-only by design (a kill cuts at most the last row); rewritten, atomically, only by
    `resumed_at`."""

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._f = _open_on_fresh_line(self.path)

    def resumed_at(self, step: int) -> None:
        """A run resumed at `step`: rows of later steps were logged by a run whose progress since
        that checkpoint was lost (killed, or rolled back with checkpoint.load_path), and the
        resumed run logs those steps again. Drop them, and any line cut by a kill (the row of a
        step being logged, so a step past the last checkpoint), so that the file holds one
        history. The file is rewritten atomically; the rows kept are kept as they were written."""
        self._f.close()
        kept, dropped, cut = [], [], []
        with open(self.path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row_step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    cut.append(line_no)
                    continue
                if row_step > step:
                    dropped.append(row_step)
                else:
                    kept.append(line if line.endswith("\n") else line + "\n")
        if dropped or cut:
            write_text_atomic(self.path, "".join(kept))
            log.warning("%s: resumed at step %d; dropped the rows of steps %s (logged by the run "
                        "that went past that checkpoint) and %d cut line(s) %s",
                        self.path, step, sorted(set(dropped)), len(cut), cut)
        self._f = _open_on_fresh_line(self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in metrics.items()})
        line = json.dumps(row) + "\n"
        try:  # appended: a failed write cuts at most this row, which the next start drops
            self._f.write(line)
            self._f.flush()
        except OSError as e:
            if is_disk_full(e):
                raise disk_full_error(self.path, f"the metrics row of step {step}", len(line)) from e
            raise

    def close(self) -> None:
        self._f.close()


def _open_on_fresh_line(path: str):
    """`path` opened for appending lines. A kill mid-write leaves the last row cut, without its
    '\\n'; the next row must start on a line of its own, not be glued onto that one."""
    f = open(path, "a", buffering=1)
    if f.tell() > 0:
        with open(path, "rb") as r:
            r.seek(-1, os.SEEK_END)
            if r.read(1) != b"\n":
                f.write("\n")
    return f


class ConsoleTracker:
    KEYS = (("score", "critic/score/mean"), ("pg_loss", "actor/pg_loss"),
            ("entropy", "actor/entropy"), ("kl", "actor/ppo_kl"),
            ("resp_len", "response_length/mean"), ("tok/s/gpu", "perf/throughput"))

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = [f"{label}={metrics[k]:.4g}" for label, k in self.KEYS if k in metrics]
        shown += [f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith("val/")]
        print(f"[step {step}] " + " ".join(shown), file=self.stream, flush=True)

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """RUN_DIR/tensorboard. After a resume at step S the writer is reopened with
    purge_step=S+1: TensorBoard then drops the events of steps > S from the earlier event files
    (logged by the run whose progress since S was lost), so the curves show each step once."""

    def __init__(self, run_dir: str):
        self.log_dir = os.path.join(run_dir, "tensorboard")
        self.writer = self._open()

    def _open(self, purge_step: Optional[int] = None):
        # Optional: the tensorboard package, only for trainer.logger=[..., tensorboard].
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(self.log_dir, purge_step=purge_step)

    def resumed_at(self, step: int) -> None:
        self.writer.close()
        self.writer = self._open(purge_step=step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run per resumable run: a job that resumes from a checkpoint continues the W&B run
    whose id is kept in RUN_DIR/wandb_run_id (resume="allow"), instead of starting a new one; a
    job that starts from step 0 (no checkpoint, even in a used run directory) starts a new W&B
    run and records its id. The W&B run is opened at the first `resumed_at` or `log`, when
    which of the two it is is known.

    W&B keeps a run's history append-only (rewinding is a private-preview server feature):
    after a resume at step S, steps S+1..K that the lost run already logged are ignored by W&B
    until the run passes K, so its curves keep the lost run's values there. A warning says so;
    metrics.jsonl and TensorBoard drop them."""

    ID_FILE = "wandb_run_id"

    def __init__(self, run_dir: str, project: str, name: str, config: dict):
        import wandb  # optional (trainer.logger wandb); here: fail at start, not at the first log

        self._wandb = wandb
        self.run_dir, self.project, self.name, self.config = run_dir, project, name, config
        self.run = None

    def _open(self, resuming: bool) -> None:
        id_path = os.path.join(self.run_dir, self.ID_FILE)
        run_id = None
        if resuming and os.path.isfile(id_path):
            with open(id_path) as f:
                run_id = f.read().strip() or None
        if run_id is None:
            run_id = self._wandb.util.generate_id()
            os.makedirs(self.run_dir, exist_ok=True)
            write_text_atomic(id_path, run_id + "\n")
        self.run = self._wandb.init(project=self.project, name=self.name, dir=self.run_dir,
                                    config=self.config, id=run_id, resume="allow")

    def resumed_at(self, step: int) -> None:
        if self.run is None:
            self._open(resuming=step > 0)  # step 0: a fresh start, a new W&B run
        logged_up_to = int(getattr(self.run, "step", 0) or 0) - 1  # W&B's next step - 1
        if logged_up_to > step:
            log.warning("W&B run %s already has steps up to %d; resumed at step %d, so W&B will "
                        "ignore steps %d..%d of this run (metrics.jsonl and TensorBoard have them)",
                        self.run.id, logged_up_to, step, step + 1, logged_up_to)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.run is None:
            self._open(resuming=False)
        self.run.log(metrics, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class Tracking:
    """The trackers named in trainer.logger; `jsonl` is always on. Only rank 0 writes."""

    def __init__(self, names: Iterable[str], run_dir: str, rank: int, project: str = "verl_mcore",
                 experiment: str = "default", config: Optional[dict] = None, console_stream=None):
        self.trackers = []
        if rank != 0:
            return
        names = set(names) | {"jsonl"}
        self.trackers.append(JsonlTracker(run_dir))
        if "console" in names:
            self.trackers.append(ConsoleTracker(console_stream))
        if "tensorboard" in names:
            self.trackers.append(TensorBoardTracker(run_dir))
        if "wandb" in names:
            self.trackers.append(WandbTracker(run_dir, project, experiment, config or {}))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for t in self.trackers:
            t.log(step, metrics)

    def resumed_at(self, step: int) -> None:
        """The run resumed from the checkpoint of `step`: what the trackers hold of later steps
        is stale (each tracker's resumed_at; the console has nothing to take back)."""
        for t in self.trackers:
            if hasattr(t, "resumed_at"):
                t.resumed_at(step)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl; a resumed run's repeated steps keep the last row.
    A line that is not JSON (cut by a kill mid-write) is skipped with a warning."""
    rows: dict[int, dict] = {}
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s line %d is not JSON (cut by a kill mid-write?); skipped: %.80s",
                            path, line_no, line)
                continue
            rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


class _NoProgress:
    def update(self, n):
        pass

    def close(self):
        pass


def progress_bar(total: int, done: int, rank: int):
    """The steps' progress bar on rank 0's stderr (a no-op elsewhere)."""
    if rank != 0:
        return _NoProgress()
    from tqdm import tqdm  # only where a bar is drawn

    return tqdm(total=total, initial=done, desc="steps", unit="step", dynamic_ncols=True,
                file=sys.stderr)
