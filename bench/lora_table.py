"""The LoRA-vs-full table of bench/bench_lora.sh from its grpo_<shape>_<mode>.json files.

    python bench/lora_table.py OUT_DIR 1.5b 3b

Per shape and mode: the step's seconds, the actor update's (timing_s/actor) and the reference
pass's, the peak memory of the step (max over phases of max_memory_allocated) and of the actor
update, and the planner's estimate of the update phase beside its measurement."""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.grpo_common import markdown_table  # noqa: E402


def _phase(result: dict, name: str) -> dict:
    return next((p for p in result["phases"] if p["phase"] == name), {})


def rows(out: str, shapes: list[str]) -> list[list]:
    table = []
    for shape in shapes:
        for mode in ("full", "lora"):
            path = os.path.join(out, f"grpo_{shape}_{mode}.json")
            if not os.path.exists(path):
                table.append([shape, mode] + ["not run"] * 7)
                continue
            with open(path) as f:
                r = json.load(f)
            actor, ref = _phase(r, "actor"), _phase(r, "ref")
            peak = max((p["peak_memory_gib"] or 0) for p in r["phases"])
            measured, planned = actor.get("peak_memory_gib"), actor.get("planner_gib")
            error = (f"{100 * (planned - measured) / measured:+.1f}%"
                     if measured and planned else "n/a")
            table.append([shape, mode, r["step"]["seconds"], actor.get("seconds"),
                          ref.get("seconds"), peak, measured, planned, error])
    return table


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out, shapes = argv[0], argv[1:]
    print(markdown_table(["shape", "mode", "step s", "actor update s", "reference s",
                          "peak GiB (step)", "peak GiB (update)", "planner GiB (update)",
                          "planner vs measured"], rows(out, shapes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
