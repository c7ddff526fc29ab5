"""Picklable descriptions of scoring functions, and the check of what a scorer returned.

Scoring runs in spawned worker processes. A user's function loaded from a file cannot be pickled
by reference into them, so the workers receive these specs and load the functions themselves.

Every per-sample scorer is called as `fn(data_source, response, ground_truth, extra_info)`
(positional, so the parameter names are the user's choice) and returns a float or
{"score": float, ...}; a user's batch class returns one such value per sample (custom.py).
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from verl_mcore.reward import custom
from verl_mcore.reward.builtin import SCORERS, check_math_compat, default_compute_score
from verl_mcore.user_code import load_user_object

ScoreFn = Callable[[str, str, Any, Optional[dict]], Any]


@dataclass(frozen=True)
class ScorerSpec:
    """kind "dispatch": default_compute_score by the sample's data_source;
    kind "builtin": the built-in scorer of data_source `name`, whatever the sample's data_source;
    kind "custom": `function` from the Python file `path`: a function called with **kwargs, or
    a class constructed with them (custom.py); `accepts` what it may be ("function", "class" or
    "any"); `key` is the config key that defined it (named in errors);
    kind "object": `obj`, a callable handed in from Python (the Python API's reward_fn), which
    scores in the trainer process only (it need not pickle: a lambda, a closure, a bound
    method); `function` and `path` then name it in messages.
    `math_compat` (reward.math_compat) is how the built-in scorers of the dispatch and builtin
    kinds compare answers; it travels with the spec, so workers score as the trainer would."""

    kind: str
    key: str
    name: Optional[str] = None
    path: Optional[str] = None
    function: Optional[str] = None
    kwargs: dict = field(default_factory=dict)
    accepts: str = "any"
    obj: Any = field(default=None, compare=False)
    math_compat: str = "verl"

    @property
    def name_field(self) -> str:
        """The config key under `key` that names the function or class (custom kind)."""
        return "function" if self.key.startswith("reward.sources") else "name"

    @property
    def kwargs_key(self) -> str:
        return "reward.custom_fn_kwargs" if self.key == "reward.custom_fn" else f"{self.key}.kwargs"

    def label(self, interface: str = "function") -> str:
        """What messages call the scorer: the user's file and function, `reward.custom_fn
        /x/rewards.py:boolean` (`:Judge.compute_reward` for a batch class: custom.interface_of
        gives `interface`), or the built-in one."""
        if self.kind == "dispatch":
            return "the built-in scorer of the sample's data_source"
        if self.kind == "builtin":
            return f"the built-in scorer {self.name!r} ({self.key})"
        method = {"batch": ".compute_reward"}.get(interface, "")
        return f"{self.key} {self.path}:{self.function}{method}"

    def load(self) -> ScoreFn:
        if self.kind in ("dispatch", "builtin"):
            check_math_compat(self.math_compat)  # math_verify: fails at start-up if missing
        if self.kind == "dispatch":
            return functools.partial(default_compute_score, math_compat=self.math_compat)
        if self.kind == "builtin":
            if self.name not in SCORERS:
                raise ValueError(f"{self.key}={self.name!r} is neither a built-in scorer "
                                 f"({sorted(SCORERS)}) nor a reward.sources name")
            return functools.partial(_score_as, self.name, math_compat=self.math_compat)
        if self.kind == "custom":
            return custom.load(load_user_object(self.path, self.function, self.key,
                                                self.name_field), self)
        if self.kind == "object":
            return custom.load(self.obj, self)
        raise ValueError(f"{self.key}: unknown scorer kind {self.kind!r}")


def _score_as(builtin: str, data_source: str, response: str, ground_truth: Any,
              extra_info: Optional[dict], math_compat: str = "verl") -> Any:
    return default_compute_score(builtin, response, ground_truth, extra_info, math_compat)


# Rewards become float32 tensors whose squares are summed over the batch (GRPO's group std, GAE's
# whitening): beyond sqrt(float32 max = 3.4e38) / sqrt(1e6 samples) ~ 1.8e16 that sum overflows to
# inf, and a reward of 1e38, finite in float64 and in float32, gave inf statistics and a zero loss.
MAX_ABS_SCORE = 1e16


class InvalidScore(ValueError):
    """A scorer returned something that is not a usable reward (the sample's score fails)."""


def check_result(value: Any) -> tuple[float, dict[str, float]]:
    """(score, numeric extras) from a scorer's return value; raises InvalidScore on anything but
    a real number with |score| <= MAX_ABS_SCORE (one NaN or inf would poison the whole update).
    Strings ("0.75"), bools and None are refused rather than converted: they are a scorer's bug
    (a parsed-but-not-converted answer, a comparison returned instead of a score)."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise InvalidScore(f"a scorer returned a dict without 'score': keys {sorted(value)}")
        for k, v in value.items():
            if k != "score" and isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
                extras[str(k)] = float(v)
        value = value["score"]
    # numbers.Real covers int, float and numpy's scalars; a 0-d tensor has __float__ too.
    # bool and numpy's / torch's bools (a comparison returned instead of a score)
    is_bool = (isinstance(value, bool) or type(value).__name__ in ("bool", "bool_")
               or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"))
    if is_bool or isinstance(value, (str, bytes)) or not (
            isinstance(value, numbers.Real) or hasattr(type(value), "__float__")):
        raise InvalidScore(f"a scorer must return a number or {{'score': number, ...}}, got "
                           f"{type(value).__name__} {str(value)[:80]!r}")
    try:
        score = float(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidScore(f"a scorer returned {type(value).__name__} {str(value)[:80]!r}, which "
                           f"is not one number ({e})") from None
    if not abs(score) <= MAX_ABS_SCORE:  # NaN fails this too
        raise InvalidScore(f"a scorer returned {score!r}: a reward must be a finite number with "
                           f"|score| <= {MAX_ABS_SCORE:g} (larger ones overflow the float32 batch "
                           "statistics); scale it down")
    return score, extras
