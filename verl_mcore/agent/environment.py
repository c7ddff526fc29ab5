"""Environments: tasks whose reward comes from the interaction (a game, a simulator).

    class GuessTheNumber:
        def __init__(self, low=1, high=100): ...             # the config's kwargs
        def reset(self, row) -> str: ...                      # the dataset row -> first observation
        def step(self, action_text) -> (str, float, bool):    # the model's turn -> (observation,
                                                              #   reward, done)
        def close(self): ...                                  # optional

named in the config like every user class (config EnvironmentConfig: path, name, kwargs). One
instance per trajectory lives in a sandbox worker (sandbox.py ToolSandbox.session): its state
stays there between steps, and nothing of it is shared with the trainer.

Start-up (load_environment): the file is imported in a probe process, where the class is checked
for reset and step and constructed once, so a bad file, name or constructor fail before any model
is built, naming the file.

At run time: a step that raises, runs past the sandbox's timeout_s or kills its worker ends the
trajectory with an observation saying so (EnvStep status "error" / "timeout", done, reward 0),
counted in the metrics; the run goes on. What cannot go on is a broken contract, the same for
every trajectory: reset raising or returning anything but text, step returning anything but
(text, finite number, bool). Those raise EnvironmentFailure naming the file, the class and the
method.
"""
from __future__ import annotations

import inspect
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Literal

from verl_mcore.user_code import check_import, load_user_object


class EnvironmentFailure(RuntimeError):
    """An environment broke its contract (reset failed, a value of the wrong type)."""


@dataclass(frozen=True)
class EnvStep:
    """One step's outcome. status ok: the environment's own; error / timeout: its step raised,
    its worker died or it ran past the limit (`observation` says which; done, reward 0)."""

    observation: str
    reward: float
    done: bool
    status: Literal["ok", "error", "timeout"] = "ok"
    seconds: float = 0.0


@dataclass(frozen=True)
class EnvSpec:
    """A loaded environment, picklable to the sandbox workers."""

    key: str
    path: str
    attr: str
    kwargs: dict

    @property
    def label(self) -> str:
        return f"{self.key} {self.path}:{self.attr}"

    def load(self):
        """In a sandbox worker: the class."""
        return load_user_object(self.path, self.attr, self.key)


def check_environment(obj: Any, key: str, path: str, name: str, kwargs: dict,
                      construct: bool = False) -> str:
    """The import probe's check (user_code.check_import): a class with reset(row) and
    step(action_text), constructed once with the kwargs when `construct`."""
    where = f"{key}.name={name!r} in {path}"
    if not inspect.isclass(obj):
        raise EnvironmentFailure(f"{where} is {type(obj).__name__}, not a class: an environment "
                                 "is a class with reset(row) and step(action_text)")
    for method, params in (("reset", ("row",)), ("step", ("action_text",))):
        fn = getattr(obj, method, None)
        if not callable(fn):
            raise EnvironmentFailure(f"{where}: class {name} has no {method}() method "
                                     f"(an environment has reset(row) and step(action_text))")
        try:
            inspect.signature(fn).bind(None, *params)  # None for self
        except TypeError as e:
            raise EnvironmentFailure(f"{where}: {name}.{method}{inspect.signature(fn)} cannot be "
                                     f"called as {method}({', '.join(params)}): {e}") from None
        except ValueError:  # no signature data: the first call will tell
            pass
    try:
        inspect.signature(obj).bind(**kwargs)
    except TypeError as e:
        raise EnvironmentFailure(f"{where}: {name}{inspect.signature(obj)} cannot be constructed "
                                 f"with {key}.kwargs {sorted(kwargs)}: {e}") from None
    if construct:
        try:
            obj(**kwargs)
        except Exception as e:
            raise EnvironmentFailure(f"{where}: constructing {name}(**{key}.kwargs) raised "
                                     f"{type(e).__name__}: {e}") from None
    return "class"


def load_environment(cfg, key: str):
    """The EnvSpec of an EnvironmentConfig at `key` (agent.environment), probed first; None
    when none is configured."""
    if not (cfg.path or cfg.name or cfg.kwargs):
        return None
    check_import(cfg.path, cfg.name, key, cfg.import_timeout_s, f"{key}.import_timeout_s",
                 check=(check_environment, (key, cfg.path, cfg.name, dict(cfg.kwargs))))
    return EnvSpec(key, os.path.abspath(os.path.expanduser(cfg.path)), cfg.name, dict(cfg.kwargs))


def checked_observation(value: Any, label: str, method: str) -> str:
    """reset's (or step's) observation, which must be text."""
    if not isinstance(value, str):
        raise EnvironmentFailure(f"{label}: {method} returned {_shown(value)} as the "
                                 "observation: it must be a str")
    return value


def checked_step(value: Any, label: str) -> tuple[str, float, bool]:
    """step's return value held to (observation: str, reward: finite number, done: bool)."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise EnvironmentFailure(f"{label}: step returned {_shown(value)}: it must return "
                                 "(observation: str, reward: float, done: bool)")
    observation, reward, done = value
    checked_observation(observation, label, "step")
    if not isinstance(reward, numbers.Real) or isinstance(reward, bool) \
            or not math.isfinite(float(reward)):
        raise EnvironmentFailure(f"{label}: step returned the reward {_shown(reward)}: it must "
                                 "be a finite number")
    if not isinstance(done, bool):
        raise EnvironmentFailure(f"{label}: step returned done={_shown(done)}: it must be a bool")
    return observation, float(reward), done


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.80}"
