"""Picklable descriptions of scoring functions, and the check of what a scorer returned.

Scoring runs in spawned worker processes. A user's function loaded from a file cannot be pickled
by reference into them, so the workers receive these specs and load the functions themselves.

Every scorer is called as `fn(data_source, response, ground_truth, extra_info)` (positional, so
the parameter names are the user's choice) and returns a float or {"score": float, ...}.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from verl_mcore.reward.builtin import SCORERS, default_compute_score

ScoreFn = Callable[[str, str, Any, Optional[dict]], Any]


@dataclass(frozen=True)
class ScorerSpec:
    """kind "dispatch": default_compute_score by the sample's data_source;
    kind "builtin": the built-in scorer of data_source `name`, whatever the sample's data_source;
    kind "custom": `function` from the Python file `path`, called with **kwargs;
    `key` is the config key that defined it (named in errors)."""

    kind: str
    key: str
    name: Optional[str] = None
    path: Optional[str] = None
    function: Optional[str] = None
    kwargs: dict = field(default_factory=dict)

    def load(self) -> ScoreFn:
        if self.kind == "dispatch":
            return default_compute_score
        if self.kind == "builtin":
            if self.name not in SCORERS:
                raise ValueError(f"{self.key}={self.name!r} is neither a built-in scorer "
                                 f"({sorted(SCORERS)}) nor a reward.sources name")
            return functools.partial(_score_as, self.name)
        if self.kind == "custom":
            from verl_mcore.data.user_code import load_user_object

            name_field = "name" if self.key == "reward.custom_fn" else "function"
            fn = load_user_object(self.path, self.function, self.key, name_field)
            if not callable(fn):
                raise ValueError(f"{self.key}: {self.function} in {self.path} is not callable")
            return functools.partial(fn, **self.kwargs) if self.kwargs else fn
        raise ValueError(f"{self.key}: unknown scorer kind {self.kind!r}")


def _score_as(builtin: str, data_source: str, response: str, ground_truth: Any,
              extra_info: Optional[dict]) -> Any:
    return default_compute_score(builtin, response, ground_truth, extra_info)


def check_result(value: Any) -> tuple[float, dict[str, float]]:
    """(score, numeric extras) from a scorer's return value; raises on anything unusable,
    including NaN and infinities (one NaN reward would poison the whole update)."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"a scorer returned a dict without 'score': keys {sorted(value)}")
        for k, v in value.items():
            if k != "score" and isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
                extras[str(k)] = float(v)
        value = value["score"]
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"a scorer must return a float or {{'score': float, ...}}, got "
                        f"{type(value).__name__} {str(value)[:80]!r}") from None
    if not math.isfinite(score):
        raise ValueError(f"a scorer returned a non-finite score {score}")
    return score, extras
