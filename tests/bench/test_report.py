"""bench/report.py: the RESULTS.md entry rendered from the suite's JSON files.

The fixtures in tests/bench/data are the JSON of the 2026-12-02 H200 runs (rollout and actor
from their logs' last JSON, grpo_step = the run with trainer.offload_between_phases=false,
per_step rows dropped)."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"


def render(tmp_path, files=None, edit=None, extra_args=()):
    """Copy the fixtures (or `files` of them) to tmp_path, apply `edit` {file: {key: value}} to
    their top level, run the report; returns (entry text, summary)."""
    out = tmp_path / "out"
    out.mkdir()
    for path in DATA.glob("*.json"):
        if files is None or path.name in files:
            shutil.copy(path, out / path.name)
    for name, changes in (edit or {}).items():
        data = json.loads((out / name).read_text())
        data.update(changes)
        (out / name).write_text(json.dumps(data))
    assert report.main([str(out), "--commit", "abc1234", *extra_args]) == 0
    return (out / "results_entry.md").read_text(), json.loads((out / "summary.json").read_text())


def table_rows(entry: str, header_start: str) -> list[list[str]]:
    """The cells of each body row of the markdown table whose header row starts with header_start."""
    lines = entry.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| " + header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_entry_from_the_h200_runs(tmp_path):
    entry, summary = render(tmp_path, extra_args=["--command", "bash bench/gpu_suite.sh"])
    head = entry.splitlines()
    assert re.fullmatch(r"## \d{4}-\d\d-\d\d \d\d:\d\d UTC — GPU suite \(bench/gpu_suite.sh\): "
                        r"rollout, actor update, GRPO step", head[0])
    assert "- device: NVIDIA H200, torch 2.11.0+cu130; ops backend: prebuilt verl_mcore._C" in head
    assert "- commit: abc1234" in head and "- command: `bash bench/gpu_suite.sh`" in head
    assert any(line.startswith("- not in this run: kernels.json") for line in head)

    assert table_rows(entry, "prompts x tokens") == [
        # runs from before bench/roofline.py: no bound recorded
        ["128 x (256 prompt + 256 new)", "22,666", "1,273", "17.8x", "", "", "28 layers, CUDA graphs, fused decode"],
        ["64 x (1024 prompt + 1024 new)", "12,715", "785", "16.2x", "", "", "28 layers, CUDA graphs, fused decode"],
    ]
    assert "| shape | seq | samples | micro-batch token budget | tokens/s | TFLOP/s | MFU vs 989 peak | " \
           "vs measured matmul ceiling | peak GiB |" in entry
    assert table_rows(entry, "shape") == [
        ["1.5b", "4096", "32 (80,420 tokens)", "4,096 (27 micro-batches)", "31,024", "310", "31.4%",
         "39.8% (ceiling 779 TFLOP/s)", "40.4"],
        ["3b", "4096", "32 (89,832 tokens)", "12,288 (8 micro-batches)", "22,391", "444", "44.9%",
         "56.9% (ceiling 781 TFLOP/s)", "115.2"],
    ]

    grpo = {row[0]: row[1:] for row in table_rows(entry, "phase (ours / TRL)")}
    assert list(grpo) == ["sync", "gen", "reward", "old_logp", "ref", "adv / scoring_rest", "actor / train",
                          "other", "**step**", "step without sync and old_logp (TRL does neither)"]
    assert grpo["sync"] == ["2.49", "210,829", "30.3", "", "", ""]  # TRL has no sync
    assert grpo["gen"] == ["6.60", "79,383", "46.1", "13.21", "39,660", "34.8"]
    assert grpo["actor / train"] == ["11.02", "47,583", "86.6", "14.34", "36,529", "18.5"]
    assert grpo["**step**"] == ["28.17", "18,613", "86.6", "31.56", "16,601", "34.8"]
    assert grpo["step without sync and old_logp (TRL does neither)"][:2] == ["21.70", "24,161"]
    assert "- TRL seconds / ours: 1.12x the full step; 1.45x against ours without sync and old_logp" in entry
    assert "overrides: trainer.offload_between_phases=false" in entry

    assert entry.rstrip().splitlines()[-3:] == [
        "- 3B actor update MFU >= 45%: **NOT met** (44.9%)",
        "- native rollout >= 5x transformers generate in the same run: **met** (17.8x, 16.2x)",
        "- GRPO step >= 5x TRL (TRL step seconds / ours): **NOT met** (1.12x)",
    ]
    assert [g["met"] for g in summary["goals"]] == [False, True, False]
    assert summary["grpo"]["trl_over_ours"] == pytest.approx(31.562084261 / 28.16823256)
    assert summary["actor"][1]["peak_tflops"] == pytest.approx(989, rel=1e-6)


def test_goals_follow_the_numbers(tmp_path):
    _, summary = render(tmp_path, edit={
        "actor_3b.json": {"mfu": 0.45},
        "rollout_long.json": {"hf_tokens_per_s": 12715.455004247262 / 4.9},  # one run below 5x
        "trl_grpo.json": {"step": {"seconds": 5 * 28.16823255999998}},
    })
    assert [g["met"] for g in summary["goals"]] == [True, False, True]


def test_the_rollout_share_of_the_bound_is_in_the_table(tmp_path):
    entry, _ = render(tmp_path, edit={"rollout.json": {"bound_tokens_per_s": 82_500.0,
                                                       "share_of_bound": 22666 / 82_500}})
    row = table_rows(entry, "prompts x tokens")[0]
    assert row[4:6] == ["82,500", "27%"]


def test_missing_parts_are_listed_and_their_goals_not_measured(tmp_path):
    entry, summary = render(tmp_path, files={"rollout.json", "grpo_step.json"})
    assert entry.splitlines()[0].endswith("GPU suite (bench/gpu_suite.sh): rollout, GRPO step")
    missing = " ".join(summary["missing"])
    for name in ["rollout_long.json", "actor_1.5b.json", "actor_3b.json", "trl_grpo.json", "kernels.json"]:
        assert name in missing
    assert "Actor update" not in entry and "TRL seconds / ours" not in entry
    assert table_rows(entry, "phase (ours / TRL)")[5] == ["adv", "0.00179", "292,635,279", "29.0", "", "", ""]
    assert "- 3B actor update MFU >= 45%: not measured in this run (needs actor_3b.json)" in entry
    assert "- GRPO step >= 5x TRL (TRL step seconds / ours): not measured in this run" in entry
    assert [g["met"] for g in summary["goals"]] == [None, True, None]


def test_commands_file_and_kernels_table(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "commands.txt").write_text("kernels\tpython3 bench/bench_kernels.py --json /o/kernels.json\n")
    (out / "kernels.json").write_text(json.dumps({
        "bench": "bench_kernels", "device": "NVIDIA H200", "torch": "2.11.0+cu130", "ops": "prebuilt",
        "copy_bytes_per_s": 4.25e12, "headers": ["what", "ms (median)"], "rows": [["GAE", "0.017"]]}))
    report.main([str(out), "--commit", "abc1234"])
    entry = (out / "results_entry.md").read_text()
    assert "  - kernels: `python3 bench/bench_kernels.py --json /o/kernels.json`" in entry
    assert "device-to-device copy 4.25 TB/s" in entry and "| GAE | 0.017 |" in entry
    assert entry.count("not measured in this run") == 3


def test_append_only_with_the_flag(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nolder entry\n")
    render(tmp_path, extra_args=["--results", str(results)])
    assert results.read_text() == "# Benchmark results\n\nolder entry\n"
    shutil.rmtree(tmp_path / "out")
    entry, _ = render(tmp_path, extra_args=["--results", str(results), "--append"])
    assert results.read_text() == "# Benchmark results\n\nolder entry\n\n" + entry


def test_no_json_is_an_error_naming_the_directory(tmp_path):
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path)) + ": none of rollout.json"):
        report.main([str(tmp_path)])


def test_commit_from_git_or_says_why_not(monkeypatch, tmp_path):
    assert report.git_commit()  # this checkout: a short hash (the device copy has no .git)
    monkeypatch.setattr(report, "ROOT", str(tmp_path))
    assert report.git_commit() == "unknown: the device copy has no .git"


def test_gpu_suite_writes_every_file_report_reads():
    suite = (ROOT / "bench" / "gpu_suite.sh").read_text()
    for name in report.FILES:
        assert f'--json "$OUT/{name}"' in suite, name
    assert 'bench/report.py "$OUT" --append --results "$OUT/RESULTS.md"' in suite


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (apt-get install -y shellcheck)")
def test_gpu_suite_passes_shellcheck():
    # -x: follow the sourced bench/device_setup.sh
    out = subprocess.run(["shellcheck", "-x", str(ROOT / "bench" / "gpu_suite.sh")], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.slow
def test_bench_actor_cpu_json_renders(tmp_path):
    """bench_actor's tiny CPU run writes --json; the report renders it (no MFU without a GPU)."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "bench/bench_actor.py", "--shape", "tiny", "--seq", "64",
                          "--samples", "8", "--warmup", "1", "--iters", "1",
                          "--json", str(out / "actor_1.5b.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report.main([str(out), "--commit", "abc1234"])
    entry = (out / "results_entry.md").read_text()
    row = table_rows(entry, "shape")[0]
    assert row[:2] == ["tiny", "64"] and row[6:] == ["", "", ""]  # MFU, ceiling, peak: CPU has none
    assert "| tokens/s | TFLOP/s | MFU vs device peak |" in entry
    assert "- 3B actor update MFU >= 45%: not measured in this run" in entry
