"""Source text of a user's reward file with classes, written to a temporary file by the tests."""

SOURCE = '''
import math
import os
import time

import numpy as np


def _log(path, what):
    # one line per construction: which process, with what
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {what}\\n")


class Scaled:
    """Per-sample: the score method."""

    def __init__(self, log, scale=1.0):
        _log(log, scale)
        self.scale = scale
        self.calls = 0

    def score(self, data_source, response, ground_truth, extra_info):
        self.calls += 1  # state kept between calls: one instance per process
        return {"score": self.scale * len(response), "pid": os.getpid(), "calls": self.calls}


class Called:
    """Per-sample through __call__, with no constructor of its own."""

    def __call__(self, data_source, response, ground_truth, extra_info):
        return 2.0 if extra_info["category"] == "chat" else 0.0


class ByCategory:
    """Batch: a bonus for math rows, else the response's length; a numpy array of B floats."""

    def __init__(self, log, bonus):
        _log(log, bonus)
        self.bonus = bonus

    def compute_reward(self, batch):
        return np.array([self.bonus if c == "math" else len(r)
                         for c, r in zip(batch["category"], batch["responses"])], dtype=np.float64)


class Lengths:
    """Batch: len() of each value of one name of the batch, as a list."""

    def __init__(self, name):
        self.name = name

    def compute_reward(self, batch):
        return [float(len(v)) for v in batch[self.name]]


class BatchSize:
    """Batch: every sample scores the size of the call it came in."""

    def compute_reward(self, batch):
        return [float(len(batch["responses"]))] * len(batch["responses"])


class Bad:
    """Batch results that fail: by the response of the call's first sample."""

    def compute_reward(self, batch):
        n, mode = len(batch["responses"]), batch["responses"][0]
        if mode == "short":
            return [1.0] * (n - 1)
        if mode == "scalar":
            return 1.0
        if mode == "values":  # one good, then NaN, a bool, a string
            return [0.5, math.nan, True, "1"][:n]
        if mode == "bools":
            return np.ones(n, dtype=bool)
        if mode == "raise":
            raise KeyError("no judge for this batch")
        if mode.startswith("sleep"):
            time.sleep(float(mode.split()[1]))
        return [1.0] * n


# ---- wrong signatures

class NoKwargs:
    def __init__(self):
        pass

    def score(self, data_source, response, ground_truth, extra_info):
        return 1.0


class WrongArity:
    def score(self, response):
        return 1.0


class Neither:
    def reward(self, data_source, response, ground_truth, extra_info):
        return 1.0


class NoBatch:
    def compute_reward(self):
        return []


class Raises:
    def __init__(self, url):
        raise ConnectionError("cannot reach the judge at " + url)

    def score(self, data_source, response, ground_truth, extra_info):
        return 1.0


def two_args(response, ground_truth):
    return 1.0


def plain(data_source, response, ground_truth, extra_info):
    return 1.0


NOT_CALLABLE = 3
'''


def write(tmp_path) -> str:
    path = tmp_path / "my_classes.py"
    path.write_text(SOURCE)
    return str(path)
