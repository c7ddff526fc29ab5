"""bench/gpu_matrix.py: the cases cover every option value of the schema, every command is a valid
one-GPU config, and the driver's judging and report work (without a GPU)."""
import dataclasses
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from bench import gpu_matrix as gm
from verl_mcore.config import ModelShape, validate

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelShape(num_attention_heads=4, num_key_value_heads=2, num_layers=2, vocab_size=40,
                  hidden_size=64)  # tools/make_tiny_model.py's defaults
# The matrix's models by path: the tiny model and its --moe variant (4 experts) beside it.
SHAPES = {"/m": TINY, "/m-moe": dataclasses.replace(TINY, num_experts=4)}


def test_every_schema_option_value_is_run_by_a_case_or_exempt():
    missing = gm.uncovered()
    assert not missing, (f"no GPU-matrix case runs {missing}: add a Case to bench/gpu_matrix.py "
                         "(or an EXEMPT entry saying why the matrix need not run it)")


def test_a_value_that_loses_its_case_is_reported():
    cases = [c for c in gm.CASES if c.name not in ("adv-remax", "kl-loss-k2")]
    assert gm.uncovered(cases) == ["algorithm.adv_estimator=remax", "actor.kl_loss_type=k2"]
    # A value counts only where the run reads it: the KL kind of a run without KL in the reward,
    # the critic's dtype of a run without a critic.
    grpo = [c for c in gm.CASES if c.name == "adv-grpo"]
    assert {"algorithm.kl_penalty=k1", "critic.dtype=fp32", "reference.dtype=fp32"} <= set(gm.uncovered(grpo))


def test_option_fields_come_from_the_schema_literals():
    fields = gm.option_fields()
    assert fields["algorithm.adv_estimator"][:2] == ("gae", "grpo")
    assert fields["trainer.offload_between_phases"] == (True, False, "auto")  # bool | "auto"
    assert fields["reward.sources[].type"] == ("rule", "custom", "reward_model", "environment")  # in a list
    assert "actor.optim.lr_schedule" in fields and "critic.optim.lr_schedule" in fields
    assert "trainer.total_steps" not in fields


def test_exemptions_name_schema_values_that_no_case_runs():
    fields, seen = gm.option_fields(), gm.coverage()
    stale = [(k, v) for k, v in gm.EXEMPT if k not in fields or v not in fields[k] or v in seen[k]]
    assert not stale, f"EXEMPT entries no longer needed (value gone, or a case runs it): {stale}"


def test_every_config_file_has_a_case():
    configs = {c.config for c in gm.CASES}
    assert {f"configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")} <= configs


def test_every_command_is_a_valid_one_gpu_config():
    names = [c.name for c in gm.CASES]
    assert len(names) == len(set(names))
    for case in gm.CASES:
        argvs = gm.commands(case, root=str(ROOT), model="/m", run_dir="/r", device="cuda", steps=3)
        assert len(argvs) == (2 if case.resume else 1)
        for argv in argvs:
            cfg = gm.config_of(argv)
            device = "cpu" if "trainer.device=cpu" in case.overrides else "cuda"
            assert cfg.trainer.device == device and cfg.model.path in SHAPES, case.name
            # Several ranks only on the CPU: the matrix has one GPU.
            assert case.ranks == 1 or device == "cpu", case.name
            assert ("torch.distributed.run" in argv) == (case.ranks > 1), case.name
            validate(cfg, case.ranks, SHAPES[cfg.model.path])  # raises ConfigError naming the fields
        assert gm.expected_steps(argvs)[-1] == (4 if case.resume else 3)
    assert gm.expected_steps(gm.commands(next(c for c in gm.CASES if c.name == "validation"),
                                         root=str(ROOT), model="/m", run_dir="/r", device="cuda",
                                         steps=3)) == [0, 1, 2, 3]


def test_select_by_glob_or_substring():
    names = lambda pattern: [c.name for c in gm.select(gm.CASES, pattern)]  # noqa: E731
    assert names("adv-r*") == ["adv-rloo", "adv-reinforce_plus_plus",
                               "adv-reinforce_plus_plus_baseline", "adv-remax"]
    assert names("offload-,config-ppo_7b") == ["offload-true", "offload-false", "offload-auto",
                                               "config-ppo_7b"]
    assert len(names(None)) == len(gm.CASES)


def test_list_prints_every_case(capsys):
    assert gm.main(["--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"{len(gm.CASES)} cases"
    assert any(line.startswith("kl-reward-fixed-k3 ") and "algorithm.kl_penalty=k3" in line
               for line in out)
    assert gm.main(["--list", "--cases", "no-such-case"]) == 2


TRACEBACK_LOG = """\
13:01:02 [rank 0] INFO verl_mcore.trainer: [step 1/3] sync 0.08s
steps:  33%|###       | 1/3 [00:01<00:02]\rsteps:  67%|######    | 2/3 [00:02<00:01]
Traceback (most recent call last):
  File "verl_mcore/algo/kl.py", line 40, in apply_kl_penalty
    kl = old - ref
RuntimeError: Expected all tensors to be on the same device, but found cuda:0 and cpu

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "verl_mcore/trainer.py", line 237, in step
    token_rewards, kl_metrics = self.token_rewards(batch, scores)
ValueError: token rewards: tensors on different devices (old_log_probs cuda:0, scores cpu)
[rank0]: some NCCL shutdown noise
"""


def test_first_error_is_the_last_tracebacks_exception():
    assert gm.first_error(TRACEBACK_LOG) == ("ValueError: token rewards: tensors on different "
                                             "devices (old_log_probs cuda:0, scores cpu)")


def test_first_error_without_a_traceback():
    config = ("13:00:00 [rank 0] INFO ...\nconfig error: invalid config:\n"
              "  - data.train_batch_size=3 is not divisible by actor.ppo_mini_batch_size=2\n"
              "  - set model.path (a Hugging Face directory) or model.checkpoint\n")
    assert gm.first_error(config) == (
        "config error: invalid config: - data.train_batch_size=3 is not divisible by "
        "actor.ppo_mini_batch_size=2 - set model.path (a Hugging Face directory) or model.checkpoint")
    assert gm.first_error("loading\nsteps: 1/3\rsteps: 2/3\r\n\n") == "steps: 2/3"
    assert gm.first_error("") == "(empty log)"


def _run_dir(tmp_path, rows):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_judge_checks_rows_finiteness_expected_metrics_and_resume(tmp_path):
    case = gm.Case("c", expect=("val/*",))
    good = [{"step": s, "time": 1.0, "actor/pg_loss": 0.1, "val/x/score/mean@1": 0.5} for s in (1, 2, 3)]
    assert gm.judge(case, _run_dir(tmp_path, good), "", [1, 2, 3]) == (3, [])
    bad = good[:2] + [{"step": 3, "time": 1.0, "actor/pg_loss": None, "actor/grad_norm": "nan"}]
    rows, problems = gm.judge(gm.Case("c", expect=("critic/vf_loss",), absent=("actor/*",)),
                              _run_dir(tmp_path / "b", bad), "", [1, 2, 3, 4])
    assert rows == 3 and problems == [
        "3 metrics rows with steps [1, 2, 3], expected [1, 2, 3, 4]",
        "non-finite metrics: actor/grad_norm, actor/pg_loss", "no metric critic/vf_loss",
        "unexpected metric actor/*"]
    resumed = gm.Case("r", resume=True)
    run = _run_dir(tmp_path / "r", [{"step": s} for s in (1, 2, 3, 4)])
    assert gm.judge(resumed, run, "INFO resumed from step 3\n", [1, 2, 3, 4]) == (4, [])
    assert gm.judge(resumed, run, "INFO steps 1..4\n", [1, 2, 3, 4])[1] == [
        "the second run's log does not say 'resumed from step 3'"]
    (tmp_path / "none").mkdir()
    assert gm.judge(case, tmp_path / "none", "", [1])[0] == 0
    eager = ("native.py:547: UserWarning: NativeEngine: CUDA graph capture failed (CUDA error: operation "
             "failed due to a previous error during capture); decoding eagerly\n")
    assert gm.judge(case, _run_dir(tmp_path / "e", good), eager, [1, 2, 3])[1] == [
        "the engine decoded eagerly: " + eager.strip()[:200]]


def _results():
    return [gm.Result("adv-gae", "algorithm.adv_estimator=gae", 0, 31.4, 3, 3),
            gm.Result("kl-reward-fixed-k1", "algorithm.use_kl_in_reward=true", 1, 12.0, 0, 3,
                      "RuntimeError: a | b on cuda:0 and cpu"),
            gm.Result("resume-grpo", "then resume to steps+1", None, 0.0, 0, 4,
                      "not run: the time budget (--budget-s) ran out")]


HEAD = {"date": "2026-12-03 10:00 UTC", "device": "NVIDIA H200", "torch": "2.11.0+cu130",
        "commit": "abc1234", "command": "bash bench/gpu_matrix.sh", "steps": 3, "jobs": 8,
        "wall_s": 301.5, "cases": 3, "passed": 1, "failed": 2}


def test_report_renders_header_and_one_row_per_case():
    text = gm.render(HEAD, _results())
    lines = text.splitlines()
    assert lines[0] == "## 2026-12-03 10:00 UTC — GPU matrix (bench/gpu_matrix.sh): 1/3 cases passed"
    assert "- device: NVIDIA H200, torch 2.11.0+cu130" in lines
    assert "- commit: abc1234" in lines and "- command: `bash bench/gpu_matrix.sh`" in lines
    table = lines[lines.index("| case | overrides | exit | s | rows | result |"):]
    assert table[2] == "| adv-gae | algorithm.adv_estimator=gae | 0 | 31 | 3/3 | ok |"
    assert table[3] == ("| kl-reward-fixed-k1 | algorithm.use_kl_in_reward=true | 1 | 12 | 0/3 | "
                        "**FAIL** RuntimeError: a \\| b on cuda:0 and cpu |")
    assert table[4].startswith("| resume-grpo | then resume to steps+1 | - | 0 | 0/4 | **FAIL** not run")


def test_out_of_budget_cases_are_reported_not_run(tmp_path, capsys):
    out = tmp_path / "out"
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # no model is built for nothing to run
    code = gm.main(["--device", "cpu", "--cases", "adv-g*,resume-grpo", "--budget-s", "0",
                    "--out", str(out), "--model", str(tmp_path / "model")])
    assert code == 1
    printed = capsys.readouterr().out
    assert "adv-grpo" in printed and "FAIL not run" in printed
    result = json.loads((out / "gpu_matrix.json").read_text())
    assert [r["name"] for r in result["results"]] == ["adv-gae", "adv-grpo", "resume-grpo"]
    assert result["header"]["failed"] == 3 and (out / "gpu_matrix.md").exists()
    with tarfile.open(out / "gpu_matrix_logs.tar.gz") as tar:
        assert tar.getnames() == []


SCRIPTS = [str(ROOT / "bench" / name) for name in ("gpu_matrix.sh", "device_setup.sh")]


def test_scripts_parse():
    for script in SCRIPTS:
        assert subprocess.run(["bash", "-n", script]).returncode == 0, script


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (apt-get install -y shellcheck)")
def test_gpu_matrix_scripts_pass_shellcheck():
    out = subprocess.run(["shellcheck", "-x", *SCRIPTS], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.slow
def test_one_real_case_on_cpu(tmp_path):
    code = gm.main(["--device", "cpu", "--cases", "adv-grpo", "--jobs", "1", "--out", str(tmp_path)])
    assert code == 0, (tmp_path / "runs" / "adv-grpo" / "log.txt").read_text()[-3000:]
    [r] = json.loads((tmp_path / "gpu_matrix.json").read_text())["results"]
    assert r["exit"] == 0 and r["rows"] == r["expected_rows"] == 3 and r["error"] == ""
    assert not (tmp_path / "runs" / "adv-grpo" / "checkpoints").exists()  # dropped after judging
