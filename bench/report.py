"""One dated bench/RESULTS.md entry from the JSON files the GPU suite wrote (bench/gpu_suite.sh).

    python3 bench/report.py OUTDIR [--results bench/RESULTS.md] [--append] [--commit C] [--command "..."]

Reads whichever of these OUTDIR holds:
  rollout.json, rollout_long.json   bench/bench_rollout.py --json
  actor_1.5b.json, actor_3b.json    bench/bench_actor.py --json
  grpo_step.json, trl_grpo.json     bench/bench_grpo_step.py --json, bench/bench_trl_grpo.py --json
  kernels.json                      bench/bench_kernels.py --json
  commands.txt                      the suite's command per part, one "name<TAB>command" a line
and writes OUTDIR/results_entry.md (the entry) and OUTDIR/summary.json (the numbers of its tables
and the goals). With --append it also appends the entry to --results.

The goals of issue 11, judged from this run's numbers alone:
  - actor update MFU on the 3B shape >= 45% (of the device's dense bf16 peak, engine/flops.py);
  - native rollout >= 5x transformers `generate` in the same run (every rollout file);
  - our GRPO step >= 5x TRL's: TRL's median step seconds / ours (full steps; the step without
    sync and old_logp, which TRL does not do, is reported beside it but not judged).

Only the standard library: the entry can be rendered on any machine from the copied files.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.grpo_common import markdown_table  # noqa: E402

# OUTDIR file -> what wrote it (for the "not in this run" line).
FILES = {
    "rollout.json": "bench_rollout.py", "rollout_long.json": "bench_rollout.py",
    "actor_1.5b.json": "bench_actor.py", "actor_3b.json": "bench_actor.py",
    "grpo_step.json": "bench_grpo_step.py", "trl_grpo.json": "bench_trl_grpo.py",
    "kernels.json": "bench_kernels.py",
    "rollout_grpo.json": "bench_rollout.py", "rollout_reasoning.json": "bench_rollout.py",
    "rollout_flash.json": "bench_rollout.py", "rollout_memory_triton.json": "bench_rollout.py",
    "rollout_memory_flash.json": "bench_rollout.py",
}
GOAL_MFU_3B = 0.45
GOAL_ROLLOUT_RATIO = 5.0
GOAL_GRPO_RATIO = 5.0
# Our phase -> TRL's phase doing the same work (same name otherwise). TRL's scoring_rest is its
# advantages, padding and metrics; its train is every forward/backward micro-step plus the step.
TRL_PHASE = {"adv": "scoring_rest", "actor": "train"}


def load(outdir: str) -> tuple[dict[str, dict], list[str]]:
    """{file name: parsed JSON} for the files present, and a note per expected file that is not."""
    found, missing = {}, []
    for name, script in FILES.items():
        path = os.path.join(outdir, name)
        if not os.path.exists(path):
            missing.append(f"{name} ({script}: not run, or it failed; see its .log)")
            continue
        try:
            with open(path) as f:
                found[name] = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            missing.append(f"{name} (unreadable: {e}; the part may have been killed while writing it)")
    return found, missing


def read_commands(outdir: str) -> list[tuple[str, str]]:
    path = os.path.join(outdir, "commands.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple(line.rstrip("\n").split("\t", 1)) for line in f if "\t" in line]


def git_commit() -> str:
    """HEAD's short hash, marked when the files differ from it: the device machine gets a copy
    of the working tree whose .git may be older than the files (then the hash is not theirs)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
        return out.stdout.strip() + (" (files differ from this commit)" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown: the device copy has no .git"


def _ratio(num, den):
    return num / den if num is not None and den else None


# ---------------------------------------------------------------------------------------------
# The numbers (summary.json)

def rollout_rows(found: dict) -> list[dict]:
    rows = []
    for name in ("rollout.json", "rollout_long.json", "rollout_grpo.json", "rollout_reasoning.json",
                 "rollout_flash.json", "rollout_memory_triton.json", "rollout_memory_flash.json"):
        r = found.get(name)
        if r is None:
            continue
        rows.append({
            "file": name, "batch": r["batch"], "prompt_len": r["prompt_len"], "n": r.get("n", 1),
            "stop_tokens": r.get("stop_tokens"), "response_length_mean": r.get("response_length_mean"),
            "gpu_memory_utilization": r.get("gpu_memory_utilization"),
            "peak_live_sequences": r.get("peak_live_sequences"),
            "contiguous_cache_slots": r.get("contiguous_cache_slots"),
            "slot_occupancy": r.get("slot_occupancy"),
            "new_tokens": r["new_tokens"], "layers": r.get("layers"), "cuda_graphs": r.get("cuda_graphs"),
            "fused_decode": r.get("fused_decode"), "attention": r.get("attention"),
            "native_tokens_per_s": r["native_tokens_per_s"], "hf_tokens_per_s": r.get("hf_tokens_per_s"),
            "native_over_hf": _ratio(r["native_tokens_per_s"], r.get("hf_tokens_per_s")),
            "unfused_tokens_per_s": r.get("unfused_tokens_per_s"),
            "first_token_agreement": r.get("first_token_agreement"),
            "bound_tokens_per_s": r.get("bound_tokens_per_s"), "share_of_bound": r.get("share_of_bound"),
        })
    return rows


def actor_rows(found: dict) -> list[dict]:
    rows = []
    for name in ("actor_1.5b.json", "actor_3b.json"):
        r = found.get(name)
        if r is None:
            continue
        rows.append({
            "file": name, "shape": r["shape"], "seq": r["seq"], "samples": r["samples"],
            "tokens_per_update": r["tokens_per_update"], "max_tokens": r["max_tokens"],
            "micro_batches": r["micro_batches"], "dtype": r.get("dtype"), "recompute": r.get("recompute"),
            "transformer_engine": r.get("transformer_engine"),
            "seconds_per_update": r["seconds_per_update"], "tokens_per_s": r["tokens_per_s"],
            "achieved_tflops": r["achieved_tflops"], "mfu": r.get("mfu"),
            # the peak bench_actor divided by (engine/flops.py peak_flops)
            "peak_tflops": _ratio(r["achieved_tflops"], r.get("mfu")),
            "matmul_ceiling_tflops": r.get("matmul_ceiling_tflops"),
            "mfu_vs_matmul_ceiling": r.get("mfu_vs_matmul_ceiling"),
            "peak_memory_gib": r.get("peak_memory_gb"),  # bench_actor divides by 2**30
        })
    return rows


def grpo_summary(found: dict) -> dict | None:
    ours, trl = found.get("grpo_step.json"), found.get("trl_grpo.json")
    if ours is None and trl is None:
        return None
    out = {"ours": None, "trl": None}
    for key, r in (("ours", ours), ("trl", trl)):
        if r is not None:
            out[key] = {"args": r.get("args"), "gpus": r.get("gpus"), "phases": r["phases"],
                        "step": r["step"], "trl": r.get("trl"),
                        "gradient_checkpointing": r.get("gradient_checkpointing")}
    if ours is not None and trl is not None:
        out["trl_over_ours"] = _ratio(trl["step"]["seconds"], ours["step"]["seconds"])
        out["trl_over_ours_without_sync_and_old_logp"] = _ratio(
            trl["step"]["seconds"], ours["step"].get("seconds_without_sync_and_old_logp"))
    return out


def goals(actor: list[dict], rollout: list[dict], grpo: dict | None) -> list[dict]:
    """Each goal: its text, the value(s) it was judged on (and as shown), met (None: not measured)
    and what measuring it needs."""
    mfu = next((a["mfu"] for a in actor if a["shape"] == "3b"), None)
    ratios = [r["native_over_hf"] for r in rollout if r["native_over_hf"] is not None]
    ratio = grpo.get("trl_over_ours") if grpo else None
    return [
        {"goal": f"3B actor update MFU >= {GOAL_MFU_3B:.0%}", "value": mfu, "shown": _f(mfu, ".1%"),
         "met": None if mfu is None else mfu >= GOAL_MFU_3B, "needs": "actor_3b.json"},
        {"goal": f"native rollout >= {GOAL_ROLLOUT_RATIO:g}x transformers generate in the same run",
         "value": ratios, "shown": ", ".join(f"{v:.1f}x" for v in ratios),
         "met": min(ratios) >= GOAL_ROLLOUT_RATIO if ratios else None,
         "needs": "rollout.json or rollout_long.json with transformers timed"},
        {"goal": f"GRPO step >= {GOAL_GRPO_RATIO:g}x TRL (TRL step seconds / ours)", "value": ratio,
         "shown": _f(ratio, ".2f", "x"), "met": None if ratio is None else ratio >= GOAL_GRPO_RATIO,
         "needs": "grpo_step.json and trl_grpo.json"},
    ]


def summarize(found: dict, missing: list[str], commit: str, command: str | None,
              commands: list[tuple[str, str]], now: datetime.datetime) -> dict:
    devices = sorted({r["device"] for r in found.values() if r.get("device")})
    torches = sorted({r["torch"] for r in found.values() if r.get("torch")})
    rollout, actor, grpo = rollout_rows(found), actor_rows(found), grpo_summary(found)
    return {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"), "device": ", ".join(devices) or "unknown",
        "torch": ", ".join(torches) or "unknown", "commit": commit, "command": command,
        "commands": [list(c) for c in commands], "files": sorted(found), "missing": missing,
        "ops": next((r["ops"] for r in found.values() if r.get("ops")), None),
        "rollout": rollout, "actor": actor, "grpo": grpo, "kernels": found.get("kernels.json"),
        "goals": goals(actor, rollout, grpo),
    }


# ---------------------------------------------------------------------------------------------
# The entry (markdown)

def _f(value, spec: str, suffix: str = "") -> str:
    return "" if value is None else format(value, spec) + suffix


def render(s: dict) -> str:
    parts = [name for name, present in (("rollout", s["rollout"]), ("actor update", s["actor"]),
                                        ("GRPO step", s["grpo"]), ("kernels", s["kernels"])) if present]
    lines = [f"## {s['date']} — GPU suite (bench/gpu_suite.sh): {', '.join(parts)}", ""]
    lines.append(f"- device: {s['device']}, torch {s['torch']}"
                 + (f"; ops backend: {s['ops']}" if s["ops"] else ""))
    lines.append(f"- commit: {s['commit']}")
    if s["command"]:
        lines.append(f"- command: `{s['command']}`")
    if s["commands"]:
        lines.append("- commands:")
        lines += [f"  - {name}: `{cmd}`" for name, cmd in s["commands"]]
    if s["missing"]:
        lines.append("- not in this run: " + "; ".join(s["missing"]))
    for section in (_rollout_md(s["rollout"]), _actor_md(s["actor"]), _grpo_md(s["grpo"]),
                    _kernels_md(s["kernels"])):
        if section:
            lines += ["", *section]
    lines += ["", "Goals of issue 11 (from this run's numbers):", ""]
    lines += [f"- {_goal_md(g)}" for g in s["goals"]]
    return "\n".join(lines) + "\n"


def _rollout_md(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    table = [[f"{r['batch']} x ({r['prompt_len']} prompt + {r['new_tokens']} new)"
              + (f", n = {r['n']}" if r.get("n", 1) > 1 else "")
              + (f", {r['stop_tokens']} stop ids (mean length {r['response_length_mean']:.0f})"
                 if r.get("stop_tokens") else ""),
              _f(r["native_tokens_per_s"], ",.0f"), _f(r["hf_tokens_per_s"], ",.0f"),
              _f(r["native_over_hf"], ".1f", "x"), _f(r.get("bound_tokens_per_s"), ",.0f"),
              _f(None if r.get("share_of_bound") is None else 100 * r["share_of_bound"], ".0f", "%"),
              f"{r['layers']} layers, " + ("CUDA graphs" if r["cuda_graphs"] else "no CUDA graphs")
              + (", fused decode" if r["fused_decode"] else ", unfused decode")
              + (f", {r['attention']} attention" if r.get("attention") else "")] for r in rows]
    out = ["Rollout (bench/bench_rollout.py: Qwen2.5-1.5B shape, random weights, bf16, one GPU; "
           "sampling at temperature 1, forced lengths unless stop ids are listed; each timed after a "
           "warm-up call, except --once runs):", "",
           markdown_table(["prompts x tokens", "native tokens/s", "transformers tokens/s",
                           "native / transformers", "bound tokens/s (same run)",
                           "share of bound", "settings"], table)]
    notes = []
    for r in rows:
        extra = [f"without the fused decode kernels {r['unfused_tokens_per_s']:,.0f} tokens/s"
                 if r["unfused_tokens_per_s"] else None,
                 f"greedy first-token agreement with transformers {r['first_token_agreement']:.0%}"
                 if r["first_token_agreement"] is not None else None,
                 f"KV cache (gpu_memory_utilization {r['gpu_memory_utilization']}): "
                 f"{r['peak_live_sequences']:.0f} sequences live at most, a contiguous cache of the "
                 f"same size holds {r['contiguous_cache_slots']}"
                 if r.get("peak_live_sequences") is not None else None,
                 f"slot occupancy {r['slot_occupancy']:.0%}" if r.get("slot_occupancy") else None]
        extra = [e for e in extra if e]
        if extra:
            notes.append(f"{r['file']}: " + "; ".join(extra))
    return out + ([""] + notes if notes else [])


def _actor_md(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    peaks = {round(r["peak_tflops"]) for r in rows if r["peak_tflops"]}
    mfu_head = f"MFU vs {peaks.pop()} peak" if len(peaks) == 1 else "MFU vs device peak"
    table = []
    for r in rows:
        ceiling = r["matmul_ceiling_tflops"]
        vs_ceiling = _f(r["mfu_vs_matmul_ceiling"], ".1%") + (f" (ceiling {ceiling:.0f} TFLOP/s)"
                                                              if ceiling else "")
        table.append([r["shape"], r["seq"], f"{r['samples']} ({r['tokens_per_update']:,} tokens)",
                      f"{r['max_tokens']:,} ({r['micro_batches']} micro-batches)",
                      _f(r["tokens_per_s"], ",.0f"), _f(r["achieved_tflops"], ".0f"), _f(r["mfu"], ".1%"),
                      vs_ceiling, _f(r["peak_memory_gib"], ".1f")])
    r0 = rows[0]
    on = {True: "on", False: "off", None: "?"}
    return ["Actor update (bench/bench_actor.py: one PPO + entropy + KL update of `samples` random "
            f"sequences, lengths uniform in [seq/4, seq], packed THD; {r0['dtype']}, recompute "
            f"{on[r0['recompute']]}, TransformerEngine {on[r0['transformer_engine']]}; median update; "
            "TFLOP/s from engine/flops.py model FLOPs):", "",
            markdown_table(["shape", "seq", "samples", "micro-batch token budget", "tokens/s", "TFLOP/s",
                            mfu_head, "vs measured matmul ceiling", "peak GiB"], table)]


def _grpo_md(g: dict | None) -> list[str]:
    if not g:
        return []
    ours, trl = g["ours"], g["trl"]
    ours_phases = {p["phase"]: p for p in ours["phases"]} if ours else {}
    trl_phases = {p["phase"]: p for p in trl["phases"]} if trl else {}
    # (our phase, TRL's phase doing the same work); None where one side has no such phase
    pairs = [(name, TRL_PHASE.get(name, name) if TRL_PHASE.get(name, name) in trl_phases else None)
             for name in ours_phases]
    pairs += [(None, name) for name in trl_phases if name not in {t for _, t in pairs}]
    pairs.sort(key=lambda pair: "other" in pair)  # the remainder of the step stays last

    def cells(p):  # seconds stay floats: markdown_table shows small ones with 3 significant digits
        if p is None:
            return ["", "", ""]
        return [p["seconds"], _f(p.get("tokens_per_s_per_gpu"), ",.0f"),
                _f(p.get("peak_memory_gib"), ".1f")]

    rows = []
    for o, t in pairs:
        label = f"{o} / {t}" if o and t and o != t else o or t
        rows.append([label] + cells(ours_phases.get(o)) + cells(trl_phases.get(t)))
    rows.append(["**step**"] + cells(ours["step"] if ours else None) + cells(trl["step"] if trl else None))
    if ours and ours["step"].get("seconds_without_sync_and_old_logp") is not None:
        st = ours["step"]
        rows.append(["step without sync and old_logp (TRL does neither)",
                     st["seconds_without_sync_and_old_logp"],
                     _f(st.get("tokens_per_s_per_gpu_without_sync_and_old_logp"), ",.0f"), "", "", "", ""])
    out = ["GRPO step by phase (bench/bench_grpo_step.py, ours, vs bench/bench_trl_grpo.py, TRL; "
           "same model, prompts, reward and loss; seconds are medians over the steps after the first, "
           "tokens/s per GPU = prompt + response tokens of the step / phase seconds / GPUs, peak = "
           "max_memory_allocated within the phase):", "",
           markdown_table(["phase (ours / TRL)", "ours s", "ours tokens/s per GPU", "ours peak GiB",
                           "TRL s", "TRL tokens/s per GPU", "TRL peak GiB"], rows), ""]
    if ours:
        a, st = ours["args"] or {}, ours["step"]
        overrides = " ".join(a.get("overrides") or []) or "none"
        out.append(f"- ours: {ours['gpus']} GPU(s), {a.get('prompts')} prompts x {a.get('n')} samples, "
                   f"prompt {a.get('prompt_len')}, response <= {a.get('response_len')} "
                   f"(mean {_f(st.get('response_length_mean'), '.1f')}), micro-batch budget "
                   f"{a.get('max_tokens')} tokens, overrides: {overrides}; actor MFU "
                   f"{_f(st.get('mfu_actor'), '.1%')}; {st.get('steps_in_median')} step(s) in the median")
    if trl:
        a, st = trl["args"] or {}, trl["step"]
        out.append(f"- TRL {trl['trl']}: {trl['gpus']} GPU(s), micro-batch {a.get('micro_batch')}, "
                   f"gradient checkpointing {'on' if trl['gradient_checkpointing'] else 'off'}, "
                   f"mean completion {_f(st.get('response_length_mean'), '.1f')}; "
                   f"{st.get('steps_in_median')} step(s) in the median; scoring_rest = its advantages, "
                   "padding and metrics, train = its micro-steps and optimizer step")
    if g.get("trl_over_ours") is not None:
        out.append(f"- TRL seconds / ours: {g['trl_over_ours']:.2f}x the full step; "
                   f"{_f(g['trl_over_ours_without_sync_and_old_logp'], '.2f', 'x')} against ours "
                   "without sync and old_logp")
    return out


def _kernels_md(k: dict | None) -> list[str]:
    if not k:
        return []
    return [f"Kernels (bench/bench_kernels.py; device-to-device copy {k['copy_bytes_per_s'] / 1e12:.2f} "
            "TB/s, bytes read + written):", "", markdown_table(k["headers"], k["rows"])]


def _goal_md(goal: dict) -> str:
    if goal["met"] is None:
        return f"{goal['goal']}: not measured in this run (needs {goal['needs']})"
    return f"{goal['goal']}: **{'met' if goal['met'] else 'NOT met'}** ({goal['shown']})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", help="the directory the suite wrote its JSON files into ($OUT)")
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "RESULTS.md"))
    p.add_argument("--append", action="store_true", help="append the entry to --results")
    p.add_argument("--commit", help="commit to record (default: git rev-parse --short HEAD)")
    p.add_argument("--command", help="the command that ran the suite, recorded in the entry")
    args = p.parse_args(argv)
    found, missing = load(args.outdir)
    if not found:
        raise SystemExit(f"{args.outdir}: none of {', '.join(FILES)} found; run bench/gpu_suite.sh "
                         f"with OUT={args.outdir} (or the benches with --json) first")
    summary = summarize(found, missing, args.commit or git_commit(), args.command,
                        read_commands(args.outdir), datetime.datetime.now(datetime.timezone.utc))
    entry = render(summary)
    with open(os.path.join(args.outdir, "results_entry.md"), "w") as f:
        f.write(entry)
    with open(os.path.join(args.outdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(entry)
    if args.append:
        new_file = not os.path.exists(args.results)
        with open(args.results, "a") as f:
            if new_file:
                f.write("# Benchmark results\n\nAppend-only, newest last. "
                        "Each entry: date, device, commit, command.\n")
            f.write("\n" + entry)
        print(f"appended to {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
