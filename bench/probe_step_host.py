"""Where one trainer step's wall time goes, per phase and per Python function (one process).

    python bench/probe_step_host.py --config configs/grpo_smollm2_arith.yaml --steps 6 \
        model.path=$MODEL trainer.device=cuda

Builds the Trainer as `python -m verl_mcore.train` would (validation and checkpoints off), runs
`--steps` steps, and profiles the last `--profile` of them with cProfile: per phase the median
wall seconds over the steps after the first, then the functions by cumulative time within the
profiled steps. For a small model the step is bound by host work (kernel launches, graph
captures, allocations, host syncs), which cProfile sees and a kernel trace does not.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--profile", type=int, default=2, help="profile the last N steps")
    p.add_argument("--top", type=int, default=45)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    from verl_mcore.config import Config
    from verl_mcore.trainer import Trainer

    cfg = Config.load(args.config, list(args.overrides) + [
        f"trainer.run_dir={tempfile.mkdtemp(prefix='probe_step_')}", "trainer.val_every=0",
        "trainer.val_before_train=false", "checkpoint.resume=never", "trainer.logger=[console]",
        "checkpoint.save_every=0", f"trainer.total_steps={args.steps}"])
    trainer = Trainer(cfg)
    profiler = cProfile.Profile()
    rows = []
    for step in range(1, args.steps + 1):
        profiled = step > args.steps - args.profile
        if profiled:
            profiler.enable()
        rows.append(trainer.step(step))
        if profiled:
            profiler.disable()
    phases = sorted({k for r in rows for k in r if k.startswith(("timing_s/", "rollout/"))})
    print("\nphase seconds, median of steps 2..%d:" % args.steps)
    for k in phases:
        vals = [r[k] for r in rows[1:] if k in r]
        if vals:
            print(f"  {k.replace('timing_s/', ''):<36} {statistics.median(vals):.4f}")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(f"\ncProfile of the last {args.profile} step(s), by cumulative time:")
    print(out.getvalue())
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    print("by own time:")
    print(out.getvalue())
    trainer.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
