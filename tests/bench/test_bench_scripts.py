"""The GRPO step benchmarks (bench/bench_grpo_step.py, bench/bench_trl_grpo.py) on their tiny CPU
setting, and the pieces they share (bench/grpo_common.py)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import grpo_common as common

ROOT = Path(__file__).resolve().parents[2]
# No old_logp: one generation feeds one optimizer step, so the update takes the old log-probs from
# its own forward pass (actor.recompute_old_log_probs=auto), as TRL does.
OUR_PHASES = ["sync", "gen", "reward", "ref", "adv", "actor", "other"]


def test_prompts_are_exactly_prompt_len_tokens_and_every_id_decodes():
    tok = common.build_tokenizer(600)
    assert len(tok) == 600
    for row in common.prompt_rows(3, 40, seed=5):
        text = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
        assert len(tok(text, add_special_tokens=False).input_ids) == 40  # our pipeline
        assert len(tok(text=[row["prompt"]])["input_ids"][0]) == 40     # TRL's plain-text path
    assert tok.decode([599, 100], skip_special_tokens=True) == " 599 100"  # filler ids decode
    assert common.score("any", " 177 23", "7") == 0.4


@pytest.mark.slow
def test_our_grpo_step_tiny_table_and_json(tmp_path):
    out = tmp_path / "step.json"
    run = subprocess.run([sys.executable, "bench/bench_grpo_step.py", "--shape", "tiny",
                          "--workdir", str(tmp_path / "work"), "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    table = run.stdout[run.stdout.index("| phase |"):]
    for phase in OUR_PHASES + ["**step**"]:
        assert f"| {phase} |" in table
    result = json.loads(out.read_text())
    phases = {p["phase"]: p for p in result["phases"]}
    assert list(phases) == OUR_PHASES
    for name, p in phases.items():
        assert math.isfinite(p["seconds"]) and (name == "other" or p["seconds"] > 0), (name, p)
        if name != "other":
            assert math.isfinite(p["tokens_per_s_per_gpu"])
    step = result["step"]
    for key in ["seconds", "tokens", "tokens_per_s_per_gpu", "mfu_actor", "rollout_tokens_per_s",
                "response_length_mean", "peak_memory_gib", "seconds_without_sync_and_old_logp"]:
        assert step[key] is not None and math.isfinite(step[key]) and step[key] > 0, key
    assert step["prompt_length_mean"] == 16 and 1 <= step["response_length_mean"] <= 8
    assert len(result["per_step"]) == 3


@pytest.mark.slow
def test_trl_grpo_tiny_table_and_json(tmp_path):
    pytest.importorskip("trl", reason="TRL is installed beside the main env (bench_trl_grpo.py)")
    out = tmp_path / "trl.json"
    run = subprocess.run([sys.executable, "bench/bench_trl_grpo.py", "--shape", "tiny",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    phases = {p["phase"]: p for p in result["phases"]}
    assert {"gen", "ref", "reward", "train", "other"} <= set(phases) and "old_logp" not in phases
    assert all(math.isfinite(p["seconds"]) for p in phases.values())
    step = result["step"]
    assert step["generations_per_step"] == [1, 1, 1] and step["completions_per_step"] == 16
    assert step["prompt_length_mean"] == 16 and math.isfinite(step["tokens_per_s_per_gpu"])


class FakeAllocator:
    def __init__(self):
        self.allocated = self.peak = 0

    def set(self, n):
        self.allocated = n
        self.peak = max(self.peak, n)

    def reset(self, device=None):
        self.peak = self.allocated


def test_trl_phase_clock_keeps_inner_peaks_in_outer_phases(monkeypatch):
    from bench.bench_trl_grpo import PhaseClock

    mem = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", mem.reset)
    clock = PhaseClock()
    mem.set(5)
    clock.start("step")
    clock.start("scoring")
    clock.timed("gen", mem.set, 50)  # generation peaks at 50, then frees
    mem.set(5)
    clock.timed("ref", mem.set, 20)
    mem.set(5)
    clock.stop("scoring")
    clock.start("train")
    mem.set(30)
    mem.set(5)
    clock.stop("train")
    clock.stop("step")
    took = clock.take()
    assert took["peak_gib"] == {k: v / 2**30 for k, v in
                                {"gen": 50, "ref": 20, "scoring": 50, "train": 30, "step": 50}.items()}
    assert set(took["seconds"]) == {"step", "scoring", "gen", "ref", "train"}
    assert clock.take() == {"seconds": {}, "peak_gib": {}}


def test_reward_model_bench_tiny(tmp_path):
    run = subprocess.run([sys.executable, "bench/bench_reward_model.py", "--workdir", str(tmp_path),
                          "--shape", "tiny", "--samples", "8", "--prompt", "8", "--response", "8",
                          "--max-tokens", "64", "--warmup", "1", "--iters", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert int(lines["samples"]) == 8 and int(lines["tokens_per_sample"]) == 16
    assert float(lines["samples_per_s"]) > 0 and 0 < float(lines["share_of_ceiling"]) < 1
