"""The four runs whose metrics are recorded (tests/e2e/drift/<name>.json) and compared step by
step (test_drift.py), so that a refactor of the trainer can show it changed no number.

Each is a few steps on the tiny quickstart model, built from the configs and launch helpers of
the e2e tests that own the feature, so it is their run, cut short:

    quickstart     configs/quickstart.yaml through the CLI, as the README runs it: GRPO, 16
                   prompts x 8 samples, 1 rank; 3 steps, validation at step 2
    ppo            test_trainer's PPO on 1 rank: GAE with a critic (values pass, then the critic
                   update), KL loss against the reference, 2 PPO epochs (old log-probs pass),
                   offload between phases; validation at step 2
    placed         test_placement's placed PPO on 4 gloo ranks: actor (+ reference) on [0, 1]
                   (DP=2), critic on [2], reward model on [3]; reward model + rule sources
    one_step_off   test_rollout_set's one_step_off on 4 gloo ranks: actor on [0, 1], the
                   rollout set on [2, 3] (2 replicas); GRPO with truncated importance weights

All run 3 steps and save checkpoints (every run saves its last step; ppo, placed and
one_step_off also step 2), so the drift check covers what a save does to the run.

The rank runs share tests/multiproc.py's pooled ranks with the other e2e tests (their imports
are paid once); the trainer seeds everything it uses, so a run in reused ranks equals one in
fresh ranks (record.py runs each config twice in the same ranks and records nothing if the two
differ; the tests also pass after test_rollout_set's and the engine tests' runs in those ranks).
A difference that shows only after some other test is state leaking between runs: a bug too.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from tests.e2e import test_placement, test_rollout_set, test_trainer
from tests.e2e.test_cpu_device import quickstart_argv
from tests.multiproc import run_on_ranks
from verl_mcore.tiny_model import make_tiny_model
from verl_mcore.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Models:
    policy: str  # the quickstart's tiny Qwen2 (make_tiny_model, seed 0)
    reward: str  # a tiny Qwen2ForSequenceClassification (seed 5), read by the placed run only


def make_models(root: Path) -> Models:
    """The tiny models of the runs under `root`: the same files on every call (seeded)."""
    return Models(make_tiny_model(str(root / "model")),
                  make_tiny_model(str(root / "reward_model"), seed=5, reward_model=True))


@dataclass(frozen=True)
class Run:
    """One recorded run: its config overrides (on configs/quickstart.yaml) and how it starts:
    the CLI (`train` None) or `train(rank, world, overrides, *train_args)` on `ranks` gloo ranks
    (an e2e test's rank body, returning the exit code)."""

    name: str
    ranks: int
    overrides: Callable[[Models, Path], list[str]]
    train: Optional[Callable[..., int]] = None
    train_args: tuple[Any, ...] = ()

    def launch(self, models: Models, run_dir: Path, *extra: str) -> list[dict]:
        """Run it into `run_dir` (with `extra` overrides appended); its metrics.jsonl rows."""
        overrides = self.overrides(models, run_dir) + list(extra)
        if self.train is None:
            done = subprocess.run(quickstart_argv(self.ranks, *overrides), cwd=ROOT,
                                  capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, (f"run {self.name!r} exited {done.returncode}:\n"
                                          f"{done.stderr[-4000:]}")
        else:
            codes = run_on_ranks(self.train, self.ranks, args=(overrides, *self.train_args),
                                 timeout=600)
            assert codes == [0] * self.ranks, f"run {self.name!r}: exit codes {codes}"
        return read_metrics(str(run_dir))

    def recorded_overrides(self, models: Models, run_dir: Path) -> list[str]:
        """The overrides with this checkout's and the temporary directories' paths named
        ({root}, {model}, {reward_model}, {run_dir}): the same in every checkout."""
        names = {str(ROOT): "{root}", models.policy: "{model}", models.reward: "{reward_model}",
                 str(run_dir): "{run_dir}"}
        out = []
        for o in self.overrides(models, run_dir):
            for path in sorted(names, key=len, reverse=True):  # a longer path first
                o = o.replace(path, names[path])
            out.append(o)
        return out


def _quickstart(m: Models, run_dir: Path) -> list[str]:
    return [f"model.path={m.policy}", f"trainer.run_dir={run_dir}", "trainer.total_steps=3",
            "trainer.val_every=2", "checkpoint.save_every=0"]


def _ppo(m: Models, run_dir: Path) -> list[str]:
    return test_trainer._overrides(m.policy, run_dir, "ppo", (1, 1, 1))


def _placed(m: Models, run_dir: Path) -> list[str]:
    return test_placement._overrides((m.policy, m.reward), run_dir, "ppo",
                                     test_placement.PLACED["ppo"])


def _one_step_off(m: Models, run_dir: Path) -> list[str]:
    return test_rollout_set._overrides(m.policy, run_dir, *test_rollout_set.PLACED,
                                       "rollout.mode=one_step_off", steps=3)


RUNS = {run.name: run for run in (
    Run("quickstart", 1, _quickstart),
    Run("ppo", 1, _ppo, test_trainer._train),
    Run("placed", 4, _placed, test_placement._train),
    Run("one_step_off", 4, _one_step_off, test_rollout_set._train, (0,)),  # lag 0: the Trainer
)}
