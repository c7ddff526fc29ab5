"""User code that blocks, exits, crashes or eats memory: at import it fails within the time limit
naming the file (and the line it was stuck on); while scoring it costs only its own sample,
reported with the sample's number and the exit code; every rank stops together."""
import io
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.multiproc import run_on_ranks
from verl_mcore.config.schema import (CustomClassConfig, DataConfig, RewardConfig,
                                      RewardSourceConfig)
from verl_mcore.user_code import UserCodeError
from verl_mcore.reward import RewardManager
from verl_mcore.reward.manager import RewardFailureError

ROOT = Path(__file__).resolve().parents[2]
ROW = {"data_source": "my/data", "reward_model": {"ground_truth": "1"}}


def _file(tmp_path, body: str, name: str = "user.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body) + "\n\ndef score(*args):\n    return 1.0\n")
    return str(path)


def _manager(path, workers=0, **kw):
    return RewardManager.from_config(RewardConfig(
        custom_fn=CustomClassConfig(path=path, name="score"), num_workers=workers, **kw))


# ------------------------------------------------------------------ at import

@pytest.mark.parametrize("workers", [0, 2])
def test_a_blocking_import_fails_in_time_naming_file_and_line(tmp_path, workers):
    path = _file(tmp_path, "import time\ntime.sleep(3600)")
    start = time.monotonic()
    with pytest.raises(UserCodeError) as e:
        _manager(path, workers, import_timeout_s=1.0)
    assert time.monotonic() - start < 10
    msg = str(e.value)
    assert f"reward.custom_fn.path={path}: importing the file did not finish within " \
           "reward.import_timeout_s=1.0 s" in msg
    assert f'File "{path}", line 2 in <module>' in msg and "move it into the function" in msg


def test_an_import_stuck_holding_the_gil_still_times_out(tmp_path):
    # One C call that never returns: a thread-based timeout could not even run here.
    path = _file(tmp_path, 'import re\nre.match(r"(a+)+$", "a" * 64 + "b")')
    with pytest.raises(UserCodeError, match="did not finish within reward.import_timeout_s=1.0 s"):
        _manager(path, import_timeout_s=1.0)


@pytest.mark.parametrize("body, problem", [
    ("import os\nos._exit(3)", "the process exited with code 3 while importing the file"),
    ("import ctypes\nctypes.string_at(0)", "killed by signal 11 (SIGSEGV) while importing"),
    ("answer = input()", "EOFError"),  # stdin is empty: no wait for a keyboard
    ("import sys\nsys.exit(5)", "importing the file failed: SystemExit: 5"),
    ("import no_such_module_here", "ModuleNotFoundError: No module named 'no_such_module_here'"),
])
def test_an_import_that_exits_or_crashes_is_named(tmp_path, body, problem):
    path = _file(tmp_path, body)
    with pytest.raises(UserCodeError) as e:
        _manager(path)
    assert path in str(e.value) and problem in str(e.value)


def test_an_import_that_exits_only_in_the_trainer_is_named(tmp_path):
    """With reward.num_workers=0 the file is imported again in the trainer after its probe: an
    os._exit that only the trainer meets (code that exits where RANK is set, say) must fail there
    naming the file, not end the trainer without a word. Run in a child: unguarded, it would end
    pytest."""
    path = _file(tmp_path, "import os\nif os.environ.get('TRAINER_PID') == str(os.getpid()):\n"
                           "    os._exit(3)")
    script = ("import os, sys\nos.environ['TRAINER_PID'] = str(os.getpid())\n"
              "from tests.hostile.test_user_code import _manager\n"
              "try:\n    _manager(sys.argv[1])\n"
              "except Exception as e:\n    print(f'raised {type(e).__name__}: {e}')\n")
    run = subprocess.run([sys.executable, "-c", script, path], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "raised ValueError" in run.stdout and path in run.stdout, run.stdout
    assert "os._exit(3)" in run.stdout, run.stdout


def test_a_custom_source_and_a_missing_name(tmp_path):
    path = _file(tmp_path, "import time\ntime.sleep(3600)")
    cfg = RewardConfig(sources=[RewardSourceConfig(name="judge", type="custom", path=path,
                                                   function="score")],
                       num_workers=0, import_timeout_s=1.0)
    with pytest.raises(UserCodeError, match=r"reward.sources\[0\].path=.*did not finish"):
        RewardManager.from_config(cfg)
    ok = _file(tmp_path, "", name="ok.py")
    cfg = RewardConfig(custom_fn=CustomClassConfig(path=ok, name="scor"), num_workers=0)
    with pytest.raises(UserCodeError, match=r"reward.custom_fn.name='scor': .* defines no such name"):
        RewardManager.from_config(cfg)


def test_a_dataset_class_that_blocks_at_import(tmp_path):
    from verl_mcore.data import load_dataset_class

    path = _file(tmp_path, "import time\ntime.sleep(3600)\nfrom verl_mcore.data import RLHFDataset\n"
                           "class Mine(RLHFDataset):\n    pass")
    cfg = DataConfig(custom_cls=CustomClassConfig(path=path, name="Mine"), import_timeout_s=1.0)
    with pytest.raises(UserCodeError) as e:
        load_dataset_class(cfg)
    assert f"data.custom_cls.path={path}: importing the file did not finish within " \
           "data.import_timeout_s=1.0 s" in str(e.value)


def test_the_cli_stops_with_the_file_named_instead_of_hanging(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    path = _file(tmp_path, "import time\ntime.sleep(3600)")
    run = subprocess.run(
        [sys.executable, "-m", "verl_mcore.train", "--config", "configs/quickstart.yaml",
         f"model.path={model}", f"trainer.run_dir={tmp_path}/run", f"reward.custom_fn.path={path}",
         "reward.custom_fn.name=score", "reward.import_timeout_s=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"error before training: reward.custom_fn.path={path}: importing the file did not " \
           "finish within reward.import_timeout_s=1.0 s" in run.stderr
    assert "Traceback" not in run.stderr


def _train(tmp_path, *overrides):
    """The CLI on the quickstart config with a tiny model; (exit code, stderr)."""
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    run = subprocess.run(
        [sys.executable, "-m", "verl_mcore.train", "--config", "configs/quickstart.yaml",
         f"model.path={model}", f"trainer.run_dir={tmp_path}/run", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    return run.returncode, run.stderr


def test_the_watchdog_names_the_file_whose_import_blocks(tmp_path):
    # The import's own limit is longer than the watchdog's: the watchdog stops the rank first,
    # and its report (the last line the user sees) names the file and both limits.
    path = _file(tmp_path, "import time\ntime.sleep(3600)")
    code, err = _train(tmp_path, f"reward.custom_fn.path={path}", "reward.custom_fn.name=score",
                       # 10 s: the checks before the import (data, tokenizer) fit well within
                       "reward.import_timeout_s=30", "trainer.collective_timeout_s=10")
    from verl_mcore.distributed.watchdog import EXIT_COLLECTIVE_TIMEOUT

    assert code == EXIT_COLLECTIVE_TIMEOUT, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("[rank 0] WATCHDOG on "), err[-3000:]
    assert (f"this rank was importing reward.custom_fn.path={path} in a probe process and "
            "checking 'score' (for at most 30 s, reward.import_timeout_s)") in last, last
    assert ("Its own limit (30 s, reward.import_timeout_s) is longer than this phase's watchdog "
            "timeout (10 s, trainer.collective_timeout_s)") in last, last


@pytest.mark.parametrize("prints", [False, True])
@pytest.mark.parametrize("body, problem", [
    ("import os\nos._exit(3)", "the process exited with code 3 while importing the file"),
    ("import ctypes\nctypes.string_at(0)", "killed by signal 11 (SIGSEGV) while importing")])
def test_an_import_that_exits_ends_its_message_with_the_error(tmp_path, prints, body, problem):
    # What the file printed comes first (when it printed anything), the error last.
    path = _file(tmp_path, ("print('loading the judge')\n" if prints else "") + body)
    with pytest.raises(UserCodeError) as e:
        _manager(path)
    lines = str(e.value).splitlines()
    assert lines[-1].startswith(f"reward.custom_fn.path={path}: ") and problem in lines[-1], \
        str(e.value)
    assert ("loading the judge" in lines) == prints and "(nothing)" not in str(e.value)


@pytest.mark.parametrize("body, last", [
    ("def helper():\n    raise ValueError('no judge configured')\nhelper()",
     "'{path}': importing the file failed: ValueError: no judge configured"),
    ("import time\ntime.sleep(3600)",
     "{path}: importing the file did not finish within reward.import_timeout_s=1.0 s. A "
     "module-level statement blocks")])
def test_an_import_that_raises_or_blocks_ends_its_message_with_the_error(tmp_path, body, last):
    # Where it failed or was stuck comes first (the user's frames), the error last.
    path = _file(tmp_path, body)
    with pytest.raises(UserCodeError) as e:
        _manager(path, import_timeout_s=1.0)
    lines = str(e.value).splitlines()
    assert lines[-1].startswith("reward.custom_fn.path=" + last.format(path=path)), str(e.value)
    assert any(f'File "{path}", line 3' in line or f'File "{path}", line 2' in line
               for line in lines[1:-1]), str(e.value)


def test_a_worker_that_cannot_load_the_file_ends_its_message_with_the_error(tmp_path):
    # The probe imports it uncapped; the workers, under reward.max_memory_mb, cannot.
    path = _file(tmp_path, "BIG = bytearray(1 << 30)")
    with pytest.raises(UserCodeError) as e:
        _manager(path, workers=1, max_memory_mb=256)
    assert str(e.value).splitlines()[-1] == (
        f"a reward worker could not load the scorers (reward.custom_fn.path={path}): ValueError: "
        f"reward.custom_fn.path='{path}': importing the file failed: MemoryError: (the workers' "
        "reward.max_memory_mb=256 applies to loading them too; the import probe has no such cap)")


def test_the_cli_ends_with_the_error_of_an_import_that_exits(tmp_path):
    path = _file(tmp_path, "import os\nos._exit(3)")
    code, err = _train(tmp_path, f"reward.custom_fn.path={path}", "reward.custom_fn.name=score")
    assert code == 2, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"error before training: reward.custom_fn.path={path}: the process exited with code 3 "
        "while importing the file (a module-level os._exit, or a crash in native code)")


# ------------------------------------------------------------------ while scoring

CRASHY = '''
import os, sys


def score(data_source, response, ground_truth, extra_info):
    if response == "exit":
        os._exit(3)
    if response == "sys.exit":
        sys.exit(4)
    if response == "segfault":
        import ctypes
        ctypes.string_at(0)
    if response == "big":
        return len(bytearray(2 << 30))
    if response == "small":
        return len(bytearray(16 << 20)) / 2**20
    return 1.0
'''


@pytest.fixture
def crashy(tmp_path):
    path = tmp_path / "crashy.py"
    path.write_text(CRASHY)
    return str(path)


def test_a_worker_that_dies_is_reported_with_sample_and_exit_code(crashy, caplog):
    with _manager(crashy, workers=1, fallback_score=-1.0) as m, \
            caplog.at_level(logging.WARNING, logger="verl_mcore.reward.manager"):
        out = m.score(["ok", "segfault", "ok", "exit"], [ROW] * 4, indices=[40, 41, 42, 43])
    assert out.scores == [1.0, -1.0, 1.0, -1.0] and out.failed == [False, True, False, True]
    assert "sample 41 (data_source='my/data')" in caplog.text
    assert "the process was killed by signal 11 (SIGSEGV)" in caplog.text
    assert "sample 43 (data_source='my/data')" in caplog.text
    assert "the process exited with code 3" in caplog.text
    assert out.first_failure[0] == 41


def test_scoring_in_workers_is_noted_with_the_users_file_and_function(tmp_path):
    """What a watchdog prints when the reward phase outlasts trainer.collective_timeout_s (a
    scorer that blocks on every sample, each cut at reward.timeout_s): the user's file and
    function, not only the pool's item count."""
    import threading

    from verl_mcore.utils.doing import notes

    path = tmp_path / "slow.py"
    path.write_text("import time\n\ndef score(*args):\n    time.sleep(3600)\n")
    seen = []
    with _manager(str(path), workers=1, timeout_s=1.0) as m:
        scoring = threading.Thread(target=m.score, args=(["a"], [ROW]), daemon=True)
        scoring.start()
        for _ in range(50):
            seen = [str(n) for _, stack in notes() for n in stack]
            if seen:
                break
            time.sleep(0.02)
        scoring.join(timeout=30)
    assert f"running reward.custom_fn {path}:score" in seen, seen
    assert any(n.startswith("scoring 1 reward items in 1 workers") for n in seen), seen


def test_in_process_exit_costs_only_its_sample(crashy, caplog):
    # reward.num_workers=0: the scorer runs in this process; os._exit / sys.exit must not end it.
    with _manager(crashy, workers=0, fallback_score=-1.0) as m, \
            caplog.at_level(logging.WARNING, logger="verl_mcore.reward.manager"):
        out = m.score(["exit", "sys.exit", "ok"], [ROW] * 3)
    assert out.scores == [-1.0, -1.0, 1.0] and out.metrics["reward/errors"] == 2
    assert "the scorer called os._exit(3)" in caplog.text and "reward.num_workers >= 1" in caplog.text
    assert 'crashy.py", line 7, in score' in caplog.text  # the traceback of the first error


def test_max_memory_mb_caps_the_workers(crashy, caplog):
    with _manager(crashy, workers=1, max_memory_mb=256, fallback_score=-1.0) as m, \
            caplog.at_level(logging.WARNING, logger="verl_mcore.reward.manager"):
        out = m.score(["big", "small", "ok"], [ROW] * 3)
    assert out.scores == [-1.0, 16.0, 1.0] and out.failed == [True, False, False]
    assert "the scorer ran out of memory over reward.max_memory_mb=256 MiB (MemoryError)" in caplog.text


# ------------------------------------------------------------------ every rank together

def _agree_body(rank, world_size, model_dir, reward_files, extra=()):
    from verl_mcore import build
    from verl_mcore.config import Config

    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), [
        f"model.path={model_dir}", f"reward.custom_fn.path={reward_files[rank]}",
        "reward.custom_fn.name=score", "reward.num_workers=0", "data.train_batch_size=16",
        f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]",
        f"data.val_files=[{ROOT}/examples/data/quickstart_val.parquet]", *extra])
    try:
        build.build_inputs(cfg, world_size).rewards.close()
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return type(e).__name__, str(e)
    return None


def test_a_file_missing_on_one_rank_stops_every_rank(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    good = _file(tmp_path, "")
    missing = str(tmp_path / "only_on_the_other_node.py")
    results = run_on_ranks(_agree_body, 2, args=(model, [good, missing]), timeout=300)
    assert results[1][0] == "ConfigError" and "no such file" in results[1][1]
    kind, msg = results[0]
    assert kind == "AgreedFailure"
    assert msg.startswith("rank 1 failed while checking the inputs: ConfigError: "
                          f"reward.custom_fn.path='{missing}': no such file")


# A verl-style dataset class whose reading never answers on some ranks (a download, a lock).
BLOCKING_DATASET = """
import os, time
from verl_mcore.data import RLHFDataset


class WaitsForTheNetwork(RLHFDataset):
    def _read_files_and_tokenize(self):
        if os.environ.get("RANK", "0") in {ranks!r}:
            time.sleep({seconds})  # the read that blocks
        super()._read_files_and_tokenize()
"""


def _blocking_dataset(tmp_path, ranks, seconds):
    path = tmp_path / "blocking_data.py"
    path.write_text(BLOCKING_DATASET.format(ranks=set(ranks), seconds=seconds))
    return ["data.custom_cls.path=" + str(path), "data.custom_cls.name=WaitsForTheNetwork"], str(path)


def test_a_dataset_class_that_blocks_while_reading_fails_in_time(tmp_path):
    from types import SimpleNamespace

    from tests.data.tiny_tokenizer import make_tiny_tokenizer
    from verl_mcore import build
    from verl_mcore.config import Config

    keys, path = _blocking_dataset(tmp_path, ["0"], 30)
    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), [*keys, "data.read_timeout_s=1",
        f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]"])
    start = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        build.build_datasets(cfg, SimpleNamespace(tokenizer=make_tiny_tokenizer()))
    assert time.monotonic() - start < 15
    msg = str(e.value)
    assert msg.startswith(f"data.custom_cls WaitsForTheNetwork ({path}) did not finish building "
                          f"the train dataset ({ROOT}/examples/data/quickstart_train.parquet) within "
                          "data.read_timeout_s=1 s (train and val together); it was here (most "
                          "recent call last):"), msg
    assert f'File "{path}", line 9, in _read_files_and_tokenize' in msg and "time.sleep(30)" in msg
    assert "raise data.read_timeout_s (below trainer.collective_timeout_s=1800)" in msg


def test_the_read_time_limit_defaults_below_the_collective_timeout():
    from verl_mcore import build
    from verl_mcore.config import Config

    assert build.read_time_limit(Config.load(None, [])) == 1350
    assert build.read_time_limit(Config.load(None, ["trainer.collective_timeout_s=900"])) == 675
    assert build.read_time_limit(Config.load(None, ["data.read_timeout_s=30"])) == 30


def test_a_dataset_blocking_on_one_rank_stops_every_rank(tmp_path):
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    good = _file(tmp_path, "")
    keys, path = _blocking_dataset(tmp_path, ["1"], 60)
    start = time.monotonic()
    results = run_on_ranks(_agree_body, 2, args=(model, [good, good],
                                                 [*keys, "data.read_timeout_s=2"]), timeout=300)
    assert time.monotonic() - start < 50
    assert results[1][0] == "ConfigError", results
    assert results[1][1].startswith(f"data.custom_cls WaitsForTheNetwork ({path}) did not finish "
                                    "building the train dataset"), results[1][1]
    kind, msg = results[0]
    assert kind == "AgreedFailure"
    assert msg.startswith("rank 1 failed while checking the inputs: ConfigError: data.custom_cls "
                          f"WaitsForTheNetwork ({path}) did not finish"), msg


# ------------------------------------------------------------------ failures name the user's code

# Every way a scorer can fail, as a user writes it: the message that stops the run must name the
# file and the function (`rewards.py:boolean`), with the sample's data source, wherever it runs.
FAILING = '''
import math, os, signal, sys


def boolean(data_source, response, ground_truth, extra_info):
    if response == "raise":
        raise ValueError("no answer found")
    if response == "list":
        return [1.0]
    if response == "nan":
        return math.nan
    if response == "sys.exit":
        sys.exit(4)
    if response == "os._exit":
        os._exit(3)
    if response == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    return response == "yes"  # a bool, not a number


class Judge:
    def compute_reward(self, batch):
        first = batch["responses"][0]
        if first == "short":
            return [1.0] * (len(batch["responses"]) - 1)
        if first == "nan":
            return [math.nan] * len(batch["responses"])
        return [boolean(*args) for args in zip(batch["data_source"], batch["responses"],
                                               batch["responses"], batch["responses"])]
'''

FAILURES = {  # response -> what the message says after the scorer's name
    "yes": "invalid: a scorer must return a number or {'score': number, ...}, got bool 'True'",
    "list": "invalid: a scorer must return a number or {'score': number, ...}, got list",
    "nan": "invalid: a scorer returned nan",
    "raise": "error: ValueError: no answer found (raised at line 7 of rewards.py, in boolean)",
    "sys.exit": "error: the scorer called sys.exit(4): return a score instead (raised at line 13",
    "os._exit": "error: ",  # and EXITED, by placement
    "killed": "the reward worker died while scoring this sample: the process was killed by "
              "signal 9 (SIGKILL) (killed from outside",
}


EXITED = {0: "error: verl_mcore.user_code.ExitCalled: the scorer called os._exit(3)",
          # with workers: the pool's word for a worker that died, with the exit code
          1: "error: the reward worker died while scoring this sample: the process exited with "
             "code 3 (the scorer ended its process: os._exit"}


@pytest.fixture
def failing(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(FAILING)
    return str(path)


def _stop_message(m, responses, **kw):
    out = m.score(responses, [{"data_source": "my/data"}] * len(responses), **kw)
    with pytest.raises(RewardFailureError) as e:
        m.check_failures(sum(out.failed), len(out.failed), out.first_failure)
    return str(e.value)


# A SIGKILL in the trainer's own process (num_workers=0) ends it: no message is possible there.
@pytest.mark.parametrize("response, workers", [(r, w) for r in FAILURES for w in (0, 2)
                                               if (r, w) != ("killed", 0)])
def test_the_stop_message_names_the_users_file_and_function(failing, workers, response):
    cfg = RewardConfig(custom_fn=CustomClassConfig(path=failing, name="boolean"),
                       num_workers=workers)
    with RewardManager.from_config(cfg) as m:
        msg = _stop_message(m, [response])
    assert (f"the first: sample 0 (data_source='my/data'), source 'rule', scorer reward.custom_fn "
            f"{failing}:boolean: ") in msg, msg
    assert FAILURES[response] in msg, msg
    if response == "os._exit":
        assert EXITED[min(workers, 1)] in msg, msg


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("first, says", [
    ("short", "invalid: compute_reward(batch) returned 1 values for a batch of 2 samples"),
    ("nan", "invalid: a scorer returned nan"),
    ("raise", "error: ValueError: no answer found (raised at line 7 of rewards.py, in boolean)"),
    ("sys.exit", "error: the scorer called sys.exit(4)"),
    ("os._exit", "os._exit")])
def test_a_failing_batch_class_is_named_by_file_class_and_method(failing, workers, first, says):
    cfg = RewardConfig(sources=[RewardSourceConfig(name="judge", type="custom", path=failing,
                                                   function="Judge")], num_workers=workers)
    with RewardManager.from_config(cfg) as m:
        msg = _stop_message(m, [first, "yes"], prompts=["p", "p"])
    assert (f"the first: sample 0 (data_source='my/data'), source 'judge', scorer "
            f"reward.sources[0] {failing}:Judge.compute_reward: ") in msg, msg
    assert (EXITED[workers] if says == "os._exit" else says) in msg, msg


def test_a_python_reward_fn_is_named_by_its_file_and_name():
    def judge(data_source, response, ground_truth, extra_info):
        raise KeyError("answer")

    with RewardManager.from_config(RewardConfig(num_workers=0), score_fn=judge) as m:
        msg = _stop_message(m, ["x"])
    assert (f"scorer reward_fn {__file__}:test_a_python_reward_fn_is_named_by_its_file_and_name."
            "<locals>.judge: error: KeyError: 'answer' (raised at line") in msg, msg


def test_the_watchdog_names_a_scorer_that_blocks_in_the_trainer(tmp_path):
    # reward.num_workers=0 has no reward.timeout_s: a scorer that blocks is stopped by the
    # watchdog, whose report names it (the stacks would too, but not which config key it is).
    from verl_mcore.distributed.watchdog import Watchdog

    path = tmp_path / "slow.py"
    path.write_text("import time\n\ndef wait(*args):\n    time.sleep(2)\n    return 1.0\n")
    fired = []
    wd = Watchdog(0.5, on_expire=fired.append, poll_s=0.05, dump_stacks=False,
                  stream=io.StringIO()).start()
    try:
        cfg = RewardConfig(custom_fn=CustomClassConfig(path=str(path), name="wait"), num_workers=0)
        with RewardManager.from_config(cfg) as m, wd.phase("score", step=3):
            m.score(["x"], [ROW])
    finally:
        wd.stop()
    assert fired and (f"in phase 'score', step 3; this rank was running reward.custom_fn "
                      f"{path}:wait in this process (reward.num_workers=0: no reward.timeout_s)"
                      in fired[0]), fired


def _watched_inputs_body(rank, world_size, model_dir, reward_file):
    """build_inputs under a watchdog shorter than the import limit; rank 1's import blocks."""
    from verl_mcore import build
    from verl_mcore.config import Config
    from verl_mcore.distributed.watchdog import Watchdog

    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), [
        f"model.path={model_dir}", f"reward.custom_fn.path={reward_file}",
        "reward.custom_fn.name=score", "reward.num_workers=0", "reward.import_timeout_s=14",
        f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]",
        f"data.val_files=[{ROOT}/examples/data/quickstart_val.parquet]"])
    fired = []
    # 10 s: what comes before the import (data, tokenizer) fits well within it on a loaded machine
    wd = Watchdog(10, rank, on_expire=fired.append, poll_s=0.1, dump_stacks=False,
                  stream=io.StringIO()).start()
    try:
        with wd.phase("check inputs"):
            build.build_inputs(cfg, world_size).rewards.close()
    except Exception:  # noqa: BLE001 - rank 1's import times out, both ranks stop: expected
        pass
    finally:
        wd.stop()
    return fired


def test_each_rank_says_what_it_was_doing_when_one_rank_blocks_importing(tmp_path):
    # One rank blocks importing the reward file (on its node only), the other waits for it: each
    # watchdog report says which, the first naming the file.
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    path = _file(tmp_path, "import os, time\nif os.environ['RANK'] == '1':\n    time.sleep(3600)")
    fired = run_on_ranks(_watched_inputs_body, 2, args=(model, path), timeout=300)
    assert fired[0] and fired[1], fired
    assert ("this rank was done checking the inputs, waiting for the other ranks to finish it"
            in fired[0][0]), fired[0]
    assert (f"this rank was importing reward.custom_fn.path={path} in a probe process" in
            fired[1][0] and "(inside: checking the inputs)" in fired[1][0]), fired[1]
