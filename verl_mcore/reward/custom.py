"""User scorers from a Python file: a function, a per-sample class or a batch class.

They are named by reward.custom_fn (a function), reward.custom_cls (a class) or a `type: custom`
entry of reward.sources (`function`: either). What the named object is decides how it is called:

  function           fn(data_source, response, ground_truth, extra_info, **kwargs), per sample
  per-sample class   Cls(**kwargs) once per scoring process, then per sample
                     obj.score(data_source, response, ground_truth, extra_info), or
                     obj(data_source, ...) when the class has `__call__` and no `score`
  batch class        Cls(**kwargs) once per scoring process, then per call
                     obj.compute_reward(batch) -> B scores (a list, tuple, numpy array or tensor);
                     a class with compute_reward is a batch class even if it has `score` too

A per-sample call returns a float or {"score": float, ...}; each value of a batch call is held to
the same rule (scorers.check_result), and a result of the wrong length fails every sample of the
call. `batch` (RewardBatch) maps names to lists of length B, in the call's sample order:

  batch["prompts"]    the prompts as the model saw them (chat template applied), decoded
  batch["responses"]  the responses, decoded
  batch[column]       every column of the dataset rows (data_source, reward_model, extra_info,
                      category, ...); None for a row without it. A column named "prompts" or
                      "responses" is hidden by the texts.

One process (a scoring worker, or the trainer with reward.num_workers=0) makes one instance and
keeps it, so a constructor may load what every call needs (a model, a judge client). The
signatures are checked by binding (inspect.signature) before any step, in the fresh-interpreter
import probe (user_code.check_import), where the class is also constructed once, so a wrong
signature or a constructor that raises fails at start-up naming the file and the class.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence


class CustomSpec(Protocol):
    """What this module reads of a custom scorer's description (reward.scorers.ScorerSpec)."""

    key: str
    path: Optional[str]
    function: Optional[str]
    kwargs: dict
    accepts: str

    @property
    def name_field(self) -> str: ...

    @property
    def kwargs_key(self) -> str: ...


SAMPLE_PARAMS = "data_source, response, ground_truth, extra_info"
_SAMPLE_ARGS = ("data_source", "response", "ground_truth", {})  # placeholders, for binding only


class RewardBatch(dict):
    """name -> [B] values (the module docstring lists the names). A plain dict, but a missing
    name says which ones there are."""

    def __missing__(self, name: str):
        raise KeyError(f"{name!r}: the reward batch has no such column; it has {sorted(self)}")


def build_batch(prompts: Sequence[str], responses: Sequence[str],
                rows: Sequence[dict]) -> RewardBatch:
    columns = list(dict.fromkeys(name for row in rows for name in row))  # first-seen order
    batch = RewardBatch({name: [row.get(name) for row in rows] for name in columns})
    batch["prompts"], batch["responses"] = list(prompts), list(responses)
    return batch


@dataclass(frozen=True)
class BatchScorer:
    """A batch class's instance, as the workers run it (worker.run_item)."""

    compute_reward: Callable[[RewardBatch], Any]


def describe(spec: CustomSpec) -> str:
    """`reward.sources[1].function='Judge' in /path/judge.py`: what error messages start with."""
    return f"{spec.key}.{spec.name_field}={spec.function!r} in {spec.path}"


def interface_of(obj: Any, spec: CustomSpec) -> str:
    """'function' | 'sample' (a class with score or __call__) | 'batch' (with compute_reward)."""
    what = describe(spec)
    if not callable(obj):
        raise ValueError(f"{what} is a {type(obj).__name__}, not a function or a class")
    if not inspect.isclass(obj):
        kind = "function"
    elif _method(obj, "compute_reward") is not None:
        kind = "batch"
    elif _method(obj, "score") is not None or _method(obj, "__call__") is not None:
        kind = "sample"
    else:
        raise ValueError(f"{what}: class {spec.function} has neither compute_reward(self, batch) "
                         f"(a batch class) nor score(self, {SAMPLE_PARAMS}) or __call__ with "
                         "those parameters (a per-sample class)")
    if spec.accepts == "function" and kind != "function":
        raise ValueError(f"{what} is a class; {spec.key} takes a function: name the class in "
                         "reward.custom_cls (its kwargs go to the constructor)")
    if spec.accepts == "class" and kind == "function":
        raise ValueError(f"{what} is not a class; {spec.key} takes a class: name a function "
                         "in reward.custom_fn")
    return kind


def check(obj: Any, spec: CustomSpec, construct: bool = False) -> str:
    """The interface of `obj` (interface_of), after checking that it can be called the way it will
    be: every signature bound to placeholder arguments, and with `construct`, the class built
    once (user_code.check_import calls this in its probe with construct=True; in the trainer
    process it must not, as an instance there would be one more than the scorers make). Raises
    ValueError naming the file, the object and the signature expected."""
    kind = interface_of(obj, spec)
    what, name, kwargs = describe(spec), spec.function, spec.kwargs
    named = ", ".join(f"{k}=..." for k in kwargs)
    if kind == "function":
        _bind(obj, _SAMPLE_ARGS, kwargs, f"{what}: {name}",
              f"{name}({SAMPLE_PARAMS}{', ' + named if named else ''}) ({spec.kwargs_key} go "
              "to each call)")
        return kind
    _bind(obj, (), kwargs, f"{what}: the constructor {name}",
          f"{name}({named}) (the kwargs of {spec.kwargs_key})")
    method = _called_method(obj, kind)
    params = "batch" if kind == "batch" else SAMPLE_PARAMS
    fn, call = _as_called(_method(obj, method), ("batch",) if kind == "batch" else _SAMPLE_ARGS)
    _bind(fn, call, {}, f"{what}: {name}.{method}", f"{method}(self, {params})")
    if construct:
        instantiate(obj, spec)
    return kind


def load(obj: Any, spec: CustomSpec) -> Callable:
    """The scorer to call, made once per process: fn(data_source, response, ground_truth,
    extra_info) per sample, or a BatchScorer."""
    kind = check(obj, spec)
    if kind == "function":
        return functools.partial(obj, **spec.kwargs) if spec.kwargs else obj
    instance = instantiate(obj, spec)
    bound = getattr(instance, _called_method(obj, kind))
    if kind == "batch":
        return BatchScorer(bound)
    return bound


def instantiate(cls: type, spec: CustomSpec) -> Any:
    try:
        return cls(**spec.kwargs)
    except (Exception, SystemExit) as e:
        raise ValueError(f"{describe(spec)}: constructing {spec.function}(**{spec.kwargs_key}) "
                         f"raised {type(e).__name__}: {e}") from e


def _called_method(cls: type, kind: str) -> str:
    if kind == "batch":
        return "compute_reward"
    return "score" if _method(cls, "score") is not None else "__call__"


def _method(cls: type, name: str) -> Any:
    """`name` as the class defines it, undecorated (staticmethod, classmethod), or None; object's
    methods and the metaclass's `__call__` do not count."""
    for klass in cls.__mro__[:-1]:
        if name in vars(klass):
            return vars(klass)[name]
    return None


def _as_called(raw: Any, args: tuple) -> tuple[Callable, tuple]:
    """The function behind a method and the arguments it receives when called on an instance
    with `args`: a placeholder first for a method's self or a classmethod's cls."""
    if isinstance(raw, staticmethod):
        return raw.__func__, args
    if isinstance(raw, classmethod):
        return raw.__func__, (None, *args)
    if inspect.isfunction(raw):
        return raw, (None, *args)
    return raw, args  # a callable object stored on the class: it gets no self


def _bind(fn: Callable, args: tuple, kwargs: dict, what: str, expected: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without signature data: the first call will tell
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise ValueError(f"{what}{sig} cannot be called as {expected}: {e}") from None
