"""Dry-run planner: layout and per-GPU memory of a config on an allocation, no GPU needed.

    python -m verl_mcore.plan --config configs/ppo_llama3_70b.yaml --nodes 8 --gpus-per-node 8 \
        [--gpu-memory-gb 80] [--host-memory-gb 1000] [--gpu-kind h100|h200] \
        [--response-fraction 1.0] [--json] [a.b=c ...]

It validates the config for the world size (the same `config.validate` the trainer runs), prints
which global ranks form each TP / PP / DP / generation group and on which node they sit, and
estimates the peak GPU memory of each phase of a step; with LoRA also what trains and what LoRA
saves at the peak against the same config without it. Last, the step-time model of
verl_mcore/plan_time.py (its docstring has the formulas and the measured rates they use): the
modelled seconds per step colocated and with a rollout set of its own (placement.rollout, sync
or rollout.mode=one_step_off), and the fastest layout's lines to paste. Exit status: 0 fits,
2 invalid config (a size does not divide, ...), 3 a phase does not fit (the message names single
knob changes that would make it fit, found by re-planning with each). Runs in seconds: it reads
the model shape from `model.path`'s config.json (a Hub id's from the Hugging Face cache, never
downloaded), or from KNOWN_SHAPES for a hub id not in the cache.

The memory model, the offload choice and the token budgets are verl_mcore/planning/memory.py
(its docstring has the formulas); the step-time model is verl_mcore/plan_time.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from typing import Optional

from verl_mcore import plan_time
from verl_mcore.config import Config, ConfigError, validate
from verl_mcore.config.placement import Placement, format_ranks
from verl_mcore.distributed.groups import GroupLayout
from verl_mcore.distributed.launch import expand_nodelist
from verl_mcore.planning.memory import (GiB, Knobs, ModelDims, USABLE_FRACTION,
                                        choose_token_budgets, lora_roles, lora_savings,
                                        lora_summary, micro_batch_json, micro_batch_report, misfits,
                                        plan_with_offload_choice, resolve_dims, reward_model_dims,
                                        suggest, total_params)
from verl_mcore.tiny_model import ensure_tiny_model

EXIT_INVALID = 2
EXIT_DOES_NOT_FIT = 3


# ---------------------------------------------------------------------------------------------
# Layout report
# ---------------------------------------------------------------------------------------------

def _ranks(group: list[int]) -> str:
    if len(group) > 2 and all(b - a == 1 for a, b in zip(group, group[1:])):
        return f"[{group[0]}-{group[-1]}]"
    return "[" + ",".join(map(str, group)) + "]"


def _groups_line(name: str, groups: list[list[int]], limit: int) -> str:
    shown = " ".join(_ranks(g) for g in groups[:limit])
    more = f" ... ({len(groups) - limit} more)" if len(groups) > limit else ""
    return f"  {name:<16}{len(groups):>4} × {len(groups[0])}: {shown}{more}"


def layout_report(cfg: Config, world: int, nodes: int, gpus_per_node: int,
                  node_names: Optional[list[str]] = None, limit: int = 8) -> str:
    placement = Placement.resolve(cfg, world, gpus_per_node)
    if not placement.colocated:  # each set's own layout inside its ranks
        lines = [f"Layout: {world} ranks = {nodes} node(s) × {gpus_per_node} GPU(s), roles placed:"]
        tp_g = cfg.rollout.tensor_parallel_size
        for s in placement.distinct_sets():
            roles = [r for r, t in placement.sets.items() if t == s]
            gen = (f"; generation TP_g={tp_g} × DP_g={len(s.ranks) // tp_g}"
                   if "actor" in roles else "")
            nodes_of = sorted({r // gpus_per_node for r in s.ranks})
            lines.append(f"  {' + '.join(roles)}: ranks {format_ranks(s.ranks)} (node(s) "
                         f"{format_ranks(nodes_of)}), TP={s.tp} × PP={s.pp} × CP={s.cp} × "
                         f"DP={s.dp}{gen}")
        return "\n".join(lines)
    p = cfg.parallel
    lay = GroupLayout(world, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size, cfg.rollout.tensor_parallel_size)
    names = node_names or [f"node{i}" for i in range(nodes)]
    node_of = lambda rank: rank // gpus_per_node  # noqa: E731 - srun --distribution=block
    lines = [f"Layout: {world} ranks = {nodes} node(s) × {gpus_per_node} GPU(s); "
             f"training TP={lay.tp} × PP={lay.pp} × CP={lay.cp} × DP={lay.dp}"
             + (f" (VPP={p.virtual_pipeline_model_parallel_size})" if p.virtual_pipeline_model_parallel_size else "")
             + f"; generation TP_g={lay.tp_gen} × DP_g={lay.dp_gen}"]
    lines.append(_groups_line("TP groups", lay.tp_groups(), limit))
    lines.append(_groups_line("PP groups", lay.pp_groups(), limit))
    lines.append(_groups_line("DP groups", lay.dp_groups(), limit))
    lines.append(_groups_line("gen TP groups", lay.gen_tp_groups(), limit))
    lines.append(_groups_line("gen DP groups", lay.gen_dp_groups(), limit))
    lines.append(_groups_line("micro-DP groups", lay.micro_dp_groups(), limit))
    split = [g for g in lay.tp_groups() if len({node_of(r) for r in g}) > 1]
    if split:
        lines.append(f"  WARNING: {len(split)} TP group(s) span nodes (e.g. {_ranks(split[0])}): "
                     "TP traffic then crosses the network; keep TP <= GPUs per node")
    lines.append("Nodes (ranks placed in blocks of --gpus-per-node, srun's default; "
                 "coordinates of the ranks on each node):")
    shown = list(range(nodes)) if nodes <= limit else list(range(limit - 1)) + [nodes - 1]
    for i in shown:
        if i == nodes - 1 and nodes > limit:
            lines.append(f"  ... ({nodes - limit} more)")
        ranks = list(range(i * gpus_per_node, (i + 1) * gpus_per_node))
        co = [lay.coords(r) for r in ranks]
        desc = ", ".join(f"{k} {_span(sorted({c[k] for c in co}))}" for k in ("pp", "dp", "tp", "dp_gen"))
        lines.append(f"  {names[i] if i < len(names) else f'node{i}'}: ranks {_ranks(ranks)}  {desc}")
    return "\n".join(lines)


def _span(values: list[int]) -> str:
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def memory_report(memory: dict, knobs: Knobs) -> str:
    usable = knobs.gpu_memory_gib * USABLE_FRACTION
    lines = [f"Memory per GPU (GiB; fits when <= {usable:.1f} = {USABLE_FRACTION:.0%} of "
             f"{knobs.gpu_memory_gib:g}; attention={knobs.attention}; "
             + ("gradients and optimizer states offloaded to host between their updates"
                if knobs.offload else "nothing offloaded") + "):"]
    for name, ph in memory.items():
        if name == "host":
            continue
        verdict = "ok" if ph["total"] <= usable * GiB else "DOES NOT FIT"
        lines.append(f"  {name:<14} {ph['total'] / GiB:7.1f}  {verdict}  (pipeline stage {ph['stage']})")
        for comp, v in ph["components"].items():
            lines.append(f"      {comp:<26}{v / GiB:8.2f}")
    host = memory["host"]
    limit = f" of {knobs.host_memory_gib:g}" if knobs.host_memory_gib is not None else ""
    lines.append(f"  host (pinned, offloaded state): {host['per_node'] / GiB:.1f} GiB per node{limit} "
                 f"({sum(host['per_gpu'].values()) / GiB:.2f} per GPU: "
                 + ", ".join(f"{k} {v / GiB:.2f}" for k, v in host["per_gpu"].items()) + ")")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _env_int(*names: str) -> Optional[int]:
    for n in names:
        v = os.environ.get(n, "")
        if v:
            try:
                return int(v.split("(")[0].split(",")[0])
            except ValueError:
                pass
    return None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="verl-mcore-plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="YAML config file")
    ap.add_argument("--nodes", type=int, default=None,
                    help="nodes (default: SLURM_JOB_NUM_NODES, else 1)")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="GPUs (= ranks) per node (default: SLURM_GPUS_ON_NODE / "
                         "SLURM_NTASKS_PER_NODE, else 1)")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0, help="GiB per GPU (80)")
    ap.add_argument("--host-memory-gb", type=float, default=None,
                    help="GiB of host memory per node to check offloaded state against")
    ap.add_argument("--attention", choices=["flash", "materialized"], default="flash",
                    help="core attention that keeps no [s, s] scores (flash/varlen/TE) or megatron's "
                         "local one that does")
    ap.add_argument("--no-offload", action="store_true",
                    help="keep gradients and optimizer states on the GPU in every phase: the same as "
                         "trainer.offload_between_phases=false (default: the config's setting; auto "
                         "offloads only when a phase would not fit otherwise)")
    ap.add_argument("--gpu-kind", choices=["h100", "h200"], default=None,
                    help="hardware rates for the step-time model and its rollout split "
                         "(verl_mcore/plan_time.py; default: h200 above 100 GiB per GPU, else h100)")
    ap.add_argument("--response-fraction", type=float, default=1.0,
                    help="mean response length / data.max_response_length for the step-time "
                         "model (1.0: every response runs to the limit)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--full", action="store_true",
                    help="list every group and node (default: the first 8 of each)")
    ap.add_argument("overrides", nargs="*", metavar="a.b.c=value")
    args = ap.parse_intermixed_args(argv)
    if not 0 < args.response_fraction <= 1:
        ap.error(f"--response-fraction {args.response_fraction}: give a number in (0, 1]")
    return args


def rollout_split(cfg: Config, dims: ModelDims, world: int, knobs: Knobs,
                  args: argparse.Namespace) -> dict:
    """The step-time model's layouts and recommendation (plan_time.py): {"text", "json"}. A
    recommended rollout set is checked with config.validate once the schema has
    placement.rollout."""
    kind = args.gpu_kind or ("h200" if knobs.gpu_memory_gib > 100 else "h100")
    hw = plan_time.HARDWARE[kind]
    why = plan_time.not_modelled(cfg)
    if why:
        return {"text": f"Rollout / training split: not modelled: {why}", "json": {"not_modelled": why}}
    cands = plan_time.splits(cfg, dims, world, knobs, hw, args.response_fraction)
    text = plan_time.split_report(cfg, cands, hw, args.response_fraction)
    best = plan_time.recommend(cands)
    if best is not None and not best.colocated and hasattr(cfg.placement, "rollout"):
        try:
            validate(Config.load(args.config, args.overrides + best.overrides().split()),
                     world, dims.shape(), knobs.gpus_per_node)
        except ConfigError as e:
            text += f"\n  config.validate rejects the recommended layout: {e}"
    return {"text": text, "json": {"hardware": asdict(hw), "response_fraction": args.response_fraction,
                                   "candidates": [s.as_dict() for s in cands],
                                   "recommended": best.as_dict() if best else None}}


def main(argv=None) -> int:
    args = parse_args(argv)
    nodes = args.nodes or _env_int("SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1
    gpn = args.gpus_per_node or _env_int("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE") or 1
    if args.no_offload:
        args.overrides.append("trainer.offload_between_phases=false")
    world = nodes * gpn
    try:
        cfg = Config.load(args.config, args.overrides)

        ensure_tiny_model(cfg.model, local_rank=0)  # one process: the layout needs its shape
        dims = resolve_dims(cfg.model.path, cfg.model.revision)
        validate(cfg, world, dims.shape(), gpn)
        reward_model_dims(cfg)
    except ConfigError as e:
        print(f"plan: config error: {e}", file=sys.stderr)
        return EXIT_INVALID
    knobs = Knobs(gpn, args.gpu_memory_gb, args.host_memory_gb, args.attention)
    as_given = cfg  # the rollout split chooses budgets per layout, as the trainer would
    cfg, budgets = choose_token_budgets(cfg, dims, world, knobs)
    offload, offload_why, memory = plan_with_offload_choice(cfg, dims, world, knobs)
    lora = lora_savings(cfg, dims, world, knobs, memory) if lora_roles(cfg) else None
    knobs = replace(knobs, offload=offload)
    bad = misfits(memory, knobs)
    split = rollout_split(as_given, dims, world, knobs, args)
    if args.json:
        print(json.dumps({"world_size": world, "nodes": nodes, "gpus_per_node": gpn,
                          "model": asdict(dims), "offload": {"enabled": offload, "why": offload_why},
                          "micro_batches": micro_batch_json(cfg, budgets),
                          "memory": memory, "does_not_fit": bad, "rollout_split": split["json"]}
                         | ({"lora": lora} if lora else {}), indent=1))
    else:
        names = None
        if os.environ.get("SLURM_JOB_NODELIST"):
            names = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
        n_params = total_params(dims)
        print(f"Model: {cfg.model.path} ({n_params / 1e9:.2f} B parameters; {dims.num_layers} layers, "
              f"hidden {dims.hidden_size}, heads {dims.num_attention_heads}/{dims.num_key_value_heads} KV)")
        print(layout_report(cfg, world, nodes, gpn, names, limit=world if args.full else 8))
        print(memory_report(memory, knobs))
        print("Micro-batches:\n" + "\n".join(f"  {line}" for line in micro_batch_report(cfg, budgets)))
        print(f"Offload between phases: {'on' if offload else 'off'} ({offload_why})")
        if lora:
            for role in lora["trainable_params"]:
                print(lora_summary(cfg, dims, role))
            print(f"LoRA saves {lora['saved_bytes'] / GiB:.1f} GiB per GPU at the peak: "
                  f"{lora['peak_phase']} {lora['peak_bytes'] / GiB:.1f} GiB, without LoRA "
                  f"{lora['peak_phase_without']} {lora['peak_bytes_without'] / GiB:.1f} GiB")
        print(split["text"])
    if bad:
        found = suggest(cfg, args.overrides, args.config, dims, world, nodes, knobs, bad)
        msg = [f"plan: does not fit: {', '.join(bad)} on {knobs.gpu_memory_gib:g} GiB GPUs"
               + (f" / {knobs.host_memory_gib:g} GiB host" if "host" in bad else "")]
        if found["fixes"]:
            msg.append("  any one of these changes makes every phase fit: " + "; ".join(found["fixes"]))
        elif found["pairs"]:
            msg.append("  no single change is enough; these pairs make every phase fit: "
                       + "; ".join(found["pairs"]))
        if found["helps"]:
            msg.append("  changes that reduce the failing phases: " + "; ".join(found["helps"]))
        if not any(found.values()):
            msg.append("  no change of one or two knobs found: use more or larger GPUs, or a "
                       "smaller model")
        print("\n".join(msg), file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
