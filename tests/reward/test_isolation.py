"""Scoring in worker processes: a scorer that sleeps past reward.timeout_s, raises, or kills its
process costs only its own sample (reward.fallback_score); the others keep their places."""
import logging
import time

import pytest

from tests.reward import user_fns
from tests.reward.test_manager import row
from verl_mcore.config.schema import CustomClassConfig, RewardConfig
from verl_mcore.user_code import UserCodeError
from verl_mcore.reward import RewardManager


@pytest.fixture(scope="module")
def flaky_manager(tmp_path_factory):
    path = user_fns.write(tmp_path_factory.mktemp("fns"))
    cfg = RewardConfig(custom_fn=CustomClassConfig(path=path, name="flaky"), num_workers=2,
                       timeout_s=1.0, fallback_score=-5.0)
    with RewardManager.from_config(cfg) as m:
        yield m


def test_failures_cost_only_their_own_sample(flaky_manager, caplog):
    responses = [f"ok {i}" for i in range(40)]
    responses[13], responses[17], responses[25] = "raise 13", "exit 17", "sleep 25"
    expected = [float(i) for i in range(40)]
    expected[13] = expected[17] = expected[25] = -5.0
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="verl_mcore.reward.manager"):
        out = flaky_manager.score(responses, [row()] * 40)
    assert out.scores == expected
    assert [i for i, f in enumerate(out.failed) if f] == [13, 17, 25]
    assert out.metrics["reward/errors"] == 2  # the raise, and the process that exited
    assert out.metrics["reward/timeouts"] == 1
    # one sleeper costs about one timeout (plus a worker restart), not 30 s
    assert time.monotonic() - start < 15
    # the first exception, with its traceback
    assert "the first scorer error" in caplog.text and "sample 13" in caplog.text
    assert "Traceback" in caplog.text and "ZeroDivisionError: the scorer failed on raise 13" in caplog.text
    assert "3 of 40 samples failed in this batch (2 errors, 1 timeouts" in caplog.text
    # the worker that exited: its sample and its exit code
    assert "sample 17 (data_source='openai/gsm8k')" in caplog.text
    assert "the process exited with code 7" in caplog.text


def test_the_pool_keeps_working_after_hangs(flaky_manager, caplog):
    out = flaky_manager.score(["sleep", "sleep", "ok 1", "ok 2"], [row()] * 4)
    assert out.scores == [-5.0, -5.0, 1.0, 2.0] and out.metrics["reward/timeouts"] == 2
    start = time.monotonic()
    out = flaky_manager.score([f"ok {i}" for i in range(6)], [row()] * 6)
    assert out.scores == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and not any(out.failed)
    assert out.metrics["reward/errors"] == 0 and out.metrics["reward/timeouts"] == 0
    assert time.monotonic() - start < 5
    with caplog.at_level(logging.ERROR, logger="verl_mcore.reward.manager"):
        flaky_manager.score(["raise again"], [row()])
    assert "the first scorer error" not in caplog.text  # only the first one gets a traceback


def test_a_scorer_file_that_fails_to_load(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise ImportError('no such dependency')\n")
    cfg = RewardConfig(custom_fn=CustomClassConfig(path=str(path), name="f"), num_workers=0)
    with pytest.raises(ValueError, match="reward.custom_fn.path=.*importing the file failed"):
        RewardManager.from_config(cfg)
    # loads in this process and in the import probe but not in a worker (whose first argument
    # is its entry, worker_process.py): the pool refuses to start, with the traceback
    path = tmp_path / "only_here.py"
    path.write_text("import sys\nif sys.argv[0] == '-c' and sys.argv[1].endswith(':serve'):\n"
                    "    raise ImportError('not in workers')\n"
                    "def f(*a):\n    return 1.0\n")
    cfg = RewardConfig(custom_fn=CustomClassConfig(path=str(path), name="f"), num_workers=1)
    with pytest.raises(UserCodeError, match="(?s)could not load the scorers.*not in workers"):
        RewardManager.from_config(cfg)
