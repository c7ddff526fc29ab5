"""Render a run's curves: `python -m verl_mcore.plot RUN_DIR [--out DIR]`.

Reads RUN_DIR/metrics.jsonl and writes one PNG per panel (reward, KL, entropy, response length,
throughput) plus `overview.png` with all of them, under RUN_DIR/plots by default.
"""
from __future__ import annotations

import argparse
import os
import sys

from verl_mcore.tracking import read_metrics

PANELS = {
    "reward": ["critic/score/mean", "val/score/mean"],
    "kl": ["actor/ppo_kl", "actor/kl_loss", "critic/kl"],
    "entropy": ["actor/entropy"],
    "response_length": ["response_length/mean"],
    "throughput": ["perf/throughput"],
}


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _val_keys(rows: list[dict]) -> list[str]:
    keys = sorted({k for r in rows for k in r if k.startswith("val/") and "/score/mean@" in k})
    return keys


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install matplotlib") from None
    rows = read_metrics(run_dir)
    if not rows:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no rows yet")
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    panels = dict(PANELS)
    panels["reward"] = ["critic/score/mean"] + _val_keys(rows)
    written = []
    fig_all, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax_all, (panel, keys) in zip(axes, panels.items()):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for target in (ax, ax_all):
            for key in keys:
                x, y = _series(rows, key)
                if x:
                    target.plot(x, y, marker="." if len(x) < 30 else None, label=key)
            target.set_title(panel.replace("_", " "))
            target.set_xlabel("step")
            if target.get_legend_handles_labels()[0]:
                target.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{panel}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig_all.tight_layout()
    path = os.path.join(out_dir, "overview.png")
    fig_all.savefig(path, dpi=100)
    plt.close(fig_all)
    written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_mcore.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/plots)")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.run_dir, "metrics.jsonl")):
        print(f"{args.run_dir} has no metrics.jsonl (is it a run directory?)", file=sys.stderr)
        return 2
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
