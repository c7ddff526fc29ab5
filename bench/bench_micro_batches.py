"""Step time of one config at the trainer's default micro-batches against hand-set token budgets
and the old padded default, measured in one process on one GPU (issue 46's Done-when).

    python bench/bench_micro_batches.py --config configs/grpo_smollm2_arith.yaml \
        model.path=DIR [--steps 4] [--budgets 4096,8192,16384,32768,65536] [--padded 2] \
        [--json OUT.json] [a.b=c ...]

The trainer is built once at its defaults (build.resolve_micro_batches chooses the budget and
logs why); then every setting trains --steps steps in turn, each with the micro-batch settings
of the actor, the critic and the reference set to it (the engine roles' `mb_kwargs`, which is all
a setting changes), and the step's median over its steps after the first is reported: the whole
step, the actor's and the critic's updates, tokens/s per GPU. Validation and checkpoints are off.
The settings run in a fixed order on a model that keeps learning, so response lengths may drift a
little between settings (the table has the mean response length of each).

A budget above what the default's offload decision leaves room for can run out of memory (the
trainer plans offload for the budget it chose): on a small model every budget fits.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=4, help="steps per setting (the first is warm-up)")
    p.add_argument("--budgets", default="4096,8192,16384,32768,65536",
                   help="hand-set token budgets, comma-separated")
    p.add_argument("--padded", type=int, default=2,
                   help="micro_batch_size_per_gpu of the padded setting (0: none)")
    p.add_argument("--json", help="write every number here")
    p.add_argument("overrides", nargs="*", metavar="a.b=c")
    return p.parse_args(argv)


def settings(default_tokens: int, budgets: list[int], padded: int) -> list[tuple[str, dict]]:
    """(name, mb_kwargs) in the order they run: the default first (the trainer's own choice),
    then the budgets, then the padded path."""
    out = [(f"default ({default_tokens} tokens)", {"max_tokens": default_tokens})]
    out += [(f"max_tokens_per_microbatch={b}", {"max_tokens": b}) for b in budgets]
    if padded:
        out.append((f"micro_batch_size_per_gpu={padded} (padded)", {"micro_batch_size": padded}))
    return out


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def summarize(rows: list[dict]) -> dict:
    """Medians after the first step of one setting's metric rows."""
    def med(key):
        vals = [r[key] for r in rows if key in r]
        return median_after_first(vals) if vals else None
    return {"step_s": med("timing_s/step"), "actor_s": med("timing_s/actor"),
            "critic_s": med("timing_s/critic"), "tokens_per_s_per_gpu": med("perf/throughput"),
            "response_length": med("response_length/mean"), "steps": len(rows)}


def table(results: list[dict], best_name: str) -> str:
    lines = ["| setting | step s | actor update s | critic update s | tokens/s per GPU | "
             "mean response | step / best |", "|---|---|---|---|---|---|---|"]
    best = next(r for r in results if r["setting"] == best_name)["step_s"]
    fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
    for r in results:
        lines.append(f"| {r['setting']} | {fmt(r['step_s'])} | {fmt(r['actor_s'])} | "
                     f"{fmt(r['critic_s'])} | {fmt(r['tokens_per_s_per_gpu'], '{:,.0f}')} | "
                     f"{fmt(r['response_length'], '{:.1f}')} | {r['step_s'] / best:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from verl_mcore.config import Config
    from verl_mcore.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="bench_mb_")
    cfg = Config.load(args.config, list(args.overrides) + [
        f"trainer.run_dir={run_dir}", "trainer.val_every=0", "trainer.val_before_train=false",
        "checkpoint.resume=never", "trainer.logger=[console]", "trainer.total_steps=100000"])
    trainer = Trainer(cfg)
    chosen = trainer.cfg.actor.max_tokens_per_microbatch
    if chosen is None:
        raise SystemExit("the config sets actor.micro_batch_size_per_gpu: leave both micro-batch "
                         "keys unset to measure the default")
    roles = [r for r in (trainer.actor, trainer.critic, trainer.reference) if r is not None]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    results, step = [], 0
    for name, kwargs in settings(chosen, budgets, args.padded):
        for role in roles:
            role.mb_kwargs = dict(kwargs)
        rows = []
        for _ in range(args.steps):
            step += 1
            rows.append(trainer.step(step))
        results.append({"setting": name, "mb_kwargs": kwargs, **summarize(rows)})
        print(f"{name}: {results[-1]}", flush=True)
    best = min((r for r in results if "max_tokens" in r["mb_kwargs"] and r is not results[0]),
               key=lambda r: r["step_s"])  # the hand-set budgets
    default = results[0]
    out = {"config": args.config, "overrides": args.overrides, "default_tokens": chosen,
           "default_step_s": default["step_s"], "best_hand_set": best["setting"],
           "best_step_s": best["step_s"], "default_over_best": default["step_s"] / best["step_s"],
           "results": results}
    if trainer.rank == 0:
        print(table(results, best["setting"]))
        print(f"default / best hand-set step: {out['default_over_best']:.2f}x "
              f"(best: {best['setting']})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    trainer.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
