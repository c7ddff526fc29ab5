"""Flow: the API's objects run in order, each on what the one before gave: one RL step.

    flow = Flow([worker, buffer, trainer], prompts=itertools.cycle(batches))
    for _ in range(steps):
        metrics = flow.step()                # or flow.step(prompts)

What `Trainer.step` does with the config's choices, with yours:

    RolloutWorker     prompts -> Experiences          (generate: sync, sample, score)
    ExperienceBuffer  Experiences -> the buffer        (add)
    PPOTrainer        buffer or Experiences -> metrics (update), then the buffer is cleared
    a callable        whatever it is given -> what it returns (a filter of experiences, say)

The metrics of a step are the worker's and the trainer's together, as the trainer logs them.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Optional, Sequence

from verl_mcore.api.buffer import ExperienceBuffer, Experiences
from verl_mcore.api.ppo import PPOTrainer
from verl_mcore.api.rollout import RolloutWorker


class Flow:
    """stages: the objects to run, in order (module docstring). prompts: an iterable of prompt
    batches that `step()` takes the next one of when it is not given one."""

    def __init__(self, stages: Sequence[Any], prompts: Optional[Iterable] = None):
        if not stages:
            raise ValueError("Flow: give the stages to run, e.g. Flow([worker, buffer, trainer])")
        for i, stage in enumerate(stages):
            if not isinstance(stage, (RolloutWorker, ExperienceBuffer, PPOTrainer)) and not callable(stage):
                raise TypeError(f"Flow: stage {i} is a {type(stage).__name__}: a RolloutWorker, an "
                                "ExperienceBuffer, a PPOTrainer or a callable")
        self.stages = list(stages)
        self._prompts = iter(prompts) if prompts is not None else None

    def step(self, prompts: Optional[Sequence[Any]] = None) -> dict[str, float]:
        """Run every stage once on `prompts` (or the next batch of the flow's prompts)."""
        if prompts is None:
            if self._prompts is None:
                raise ValueError("Flow.step: give the prompts, or make the Flow with prompts=")
            prompts = next(self._prompts)
        start = time.perf_counter()
        value: Any = prompts
        metrics: dict[str, float] = {}
        for i, stage in enumerate(self.stages):
            if isinstance(stage, RolloutWorker):
                value = stage.generate(value)
                metrics.update(value.metrics)
            elif isinstance(stage, ExperienceBuffer):
                stage.add(_given(value, Experiences, i, "ExperienceBuffer"))
                value = stage
            elif isinstance(stage, PPOTrainer):
                metrics.update(stage.update(_given(value, (Experiences, ExperienceBuffer), i,
                                                   "PPOTrainer")))
                if isinstance(value, ExperienceBuffer):
                    value.clear()  # on-policy: the next step samples afresh
                value = metrics
            else:
                value = stage(value)
        metrics["timing_s/step"] = time.perf_counter() - start
        return metrics


def _given(value: Any, kinds, i: int, stage: str):
    if not isinstance(value, kinds):
        raise TypeError(f"Flow: stage {i} ({stage}) got a {type(value).__name__} from the stage "
                        "before it; put a RolloutWorker (or an ExperienceBuffer after one) first")
    return value
