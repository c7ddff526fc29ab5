"""Validation metrics: what `Trainer.validate` logs over the whole validation set.

Per data source (the row's `data_source`), as `val/<data_source>/<metric>`:

  score/mean@n, pass@n  the total reward; pass@n: the share of prompts whose best of the n
                        samples (rollout.val_n) scores >= trainer.val_pass_threshold
  reward/<extra>/mean   the extra keys of dict-returning scorers (RewardOutput.extras), the mean
                        of the samples that have one, named as in training (reward/<...>/mean)
  trainer.val_metrics   text metrics of each response against its reference, the row's
                        reward_model.ground_truth (a string, or a number written as one):
      exact_match       the share of responses equal to the reference, both stripped
      rouge             rouge1 / rouge2 / rougeL: the mean F1 of the samples (rouge-score)
      bleu              sacrebleu's corpus BLEU (0-100) of all samples
      <other name>      a metric of the HF `evaluate` library (evaluate.load(name)); each
                        number of its result is logged as <name>/<key> (a list as its mean)
                        trainer.val_metric_kwargs.<name> goes to RougeScorer(...),
                        sacrebleu.corpus_bleu(...) or the evaluate module's compute(...)
  no_reference          samples whose row has no usable reference: left out of the text
                        metrics, counted here
  trainer.val_metric_fn a user function (responses, references, rows) -> {name: float}, called
                        once per data source with all its samples (a reference is None where
                        the row has none); each value is logged as val/<data_source>/<name>

With rollout.val_n > 1 each of the n responses counts as one sample against its reference.

Where it runs: validate() generates on every replica and gathers each batch's rollout and scores
onto every rank (Sampler.generate, Scorer.score); rank 0 keeps the samples (`ValSamples`),
computes once over the whole set, writes trainer.log_val_generations rows, and broadcasts the
metrics, so every rank logs the same values and a user metric runs once, not once per rank. A
failure there is broadcast too and raised on every rank alike (ValMetricError).
"""
from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist

from verl_mcore.config.loading import ConfigError
from verl_mcore.config.validate import BUILTIN_VAL_METRICS, val_metric_errors
from verl_mcore.user_code import call_with_time_limit, check_import, load_user_object
from verl_mcore.utils.files import write_text_atomic

log = logging.getLogger(__name__)

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


class ValMetricError(RuntimeError):
    """A validation metric failed; raised on every rank alike (rank 0's failure, broadcast)."""


# ---- the metrics, pure functions of texts -----------------------------------------------------

def exact_match(responses: list[str], references: list[str]) -> float:
    """The share of responses equal to their reference, both stripped of outer whitespace."""
    return sum(r.strip() == ref.strip() for r, ref in zip(responses, references)) / len(responses)


def rouge(responses: list[str], references: list[str], **kwargs) -> dict[str, float]:
    """Mean F1 over the samples of rouge1, rouge2 and rougeL (rouge-score; `kwargs` to its
    RougeScorer, e.g. use_stemmer=True)."""
    from rouge_score import rouge_scorer  # optional: only trainer.val_metrics=[rouge] needs it

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), **kwargs)
    sums = dict.fromkeys(ROUGE_TYPES, 0.0)
    for response, ref in zip(responses, references):
        for k, s in scorer.score(ref, response).items():  # score(target, prediction)
            sums[k] += s.fmeasure
    return {k: v / len(responses) for k, v in sums.items()}


def bleu(responses: list[str], references: list[str], **kwargs) -> float:
    """sacrebleu's corpus BLEU (0-100) with one reference per sample (`kwargs` to corpus_bleu,
    e.g. lowercase=True, tokenize="char")."""
    import sacrebleu  # optional: only trainer.val_metrics=[bleu] needs it

    return float(sacrebleu.corpus_bleu(responses, [references], **kwargs).score)


def evaluate_numbers(name: str, result: Any) -> dict[str, float]:
    """The numbers of an `evaluate` module's result as <name>/<key>: a number as is, a list of
    numbers as its mean (BERTScore gives per-sample lists); anything else is not a metric."""
    out = {}
    for k, v in (result or {}).items():
        if isinstance(v, (list, tuple)) and v and all(_is_number(x) for x in v):
            v = sum(float(x) for x in v) / len(v)
        if _is_number(v):
            out[f"{name}/{k}"] = float(v)
    return out


def _is_number(v: Any) -> bool:
    # numpy / torch scalars too (a metric library returns those)
    return ((isinstance(v, (int, float)) and not isinstance(v, bool))
            or (hasattr(v, "item") and getattr(v, "ndim", 1) == 0))


_warned_list_references = False


def reference_of(row: dict) -> Optional[str]:
    """The row's reward_model.ground_truth as text; None when it has none a text metric can use
    (missing, None, or not a string or a number). A list of references (several acceptable
    answers, as some verl datasets hold) is not scored by the text metrics: said once in the
    log, and counted in no_reference."""
    global _warned_list_references
    truth = (row.get("reward_model") or {}).get("ground_truth")
    if isinstance(truth, str):
        return truth
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        return str(truth)
    if isinstance(truth, (list, tuple)) and not _warned_list_references:
        _warned_list_references = True
        log.warning("validation: reward_model.ground_truth is a list (%d items) in some rows; the "
                    "text metrics (trainer.val_metrics) compare one reference and skip those rows "
                    "(counted in val/<data_source>/no_reference); trainer.val_metric_fn gets them "
                    "as None and the rows themselves", len(truth))
    return None


# ---- start-up checks --------------------------------------------------------------------------

def check_metric_fn(fn: Any, key: str, construct: bool = False) -> str:
    """A user metric function must take (responses, references, rows). Module level: the import
    probe (user_code.check_import) calls it by name."""
    if not callable(fn):
        raise ValueError(f"{key}.name: {fn!r} is not a function; a validation metric function is "
                         f"fn(responses, references, rows) -> dict[str, float]")
    try:
        inspect.signature(fn).bind([], [], [])
    except TypeError as e:
        raise ValueError(f"{key}.name: {getattr(fn, '__name__', fn)}{inspect.signature(fn)} cannot "
                         f"be called as fn(responses, references, rows) -> dict[str, float]: "
                         f"{e}") from None
    except ValueError:  # a builtin without a signature: checked when it is called
        pass
    return "function"


def _cached_evaluate_modules() -> list[str]:
    """The metric modules `evaluate` has cached on this machine (it loads those offline)."""
    try:  # optional: the HF `evaluate` library, for metrics named by it
        from evaluate.config import HF_MODULES_CACHE
    except Exception:  # noqa: BLE001 - a broken evaluate install: nothing to name
        return []
    root = os.path.join(HF_MODULES_CACHE, "evaluate_modules", "metrics")
    names = set()
    for ns in os.listdir(root) if os.path.isdir(root) else []:
        names.update(n.split("--")[-1] for n in os.listdir(os.path.join(root, ns)) if n != "__pycache__")
    return sorted(names)


# ---- what validate() uses ---------------------------------------------------------------------

@dataclass
class ValSamples:
    """Every validation sample of one validate(), in validation order (rank 0 keeps them).

    Every sample of a prompt shares a `group` id (pass@n), unique over the validation batches."""

    sources: list[str] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    extras: dict[str, list[Optional[float]]] = field(default_factory=dict)  # name -> per sample
    keep_prompts: int = 0  # trainer.log_val_generations: the prompts decoded and kept
    prompts: list[str] = field(default_factory=list)  # of the first keep_prompts samples

    def add(self, rollout, scores: list[float], extras: dict[str, list],
            prompt_texts: Callable[[int], list[str]]) -> None:
        """One gathered validation batch (a Trainer Rollout, its scores and scorer extras).
        prompt_texts(k): the decoded prompts of its first k samples (only those written to the
        generations file are decoded)."""
        first, offset = len(self.scores), (max(self.groups) + 1 if self.groups else 0)
        k = min(self.keep_prompts - len(self.prompts), len(scores))
        if k > 0:
            self.prompts += prompt_texts(k)
        self.sources += [str(row.get("data_source", "unknown")) for row in rollout.rows]
        self.groups += [offset + g for g in rollout.group_ids.tolist()]
        self.scores += scores
        self.responses += rollout.responses
        self.rows += rollout.rows
        for name in set(self.extras) | set(extras):
            values = extras.get(name, [None] * len(scores))
            self.extras.setdefault(name, [None] * first).extend(values)


@dataclass
class ValMetrics:
    names: list[str]
    kwargs: dict[str, dict]
    pass_threshold: float
    n: int  # samples per prompt (rollout.val_n)
    num_generations: int  # trainer.log_val_generations
    fn: Optional[Callable] = None  # trainer.val_metric_fn
    evaluate_modules: dict[str, Any] = field(default_factory=dict)
    fn_timeout_s: float = 600.0  # trainer.val_metric_fn.timeout_s

    @classmethod
    def from_config(cls, cfg, rank: int) -> "ValMetrics":
        """Check and load what the config names, before any model is built: the `evaluate`
        metrics load (a name it cannot load fails naming the key and the metrics on offer),
        the user function is imported under its time limit and its signature checked."""
        t = cfg.trainer
        errs = val_metric_errors(t)
        if errs:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errs))
        modules = {}
        for i, name in enumerate(t.val_metrics):
            if name not in BUILTIN_VAL_METRICS:
                modules[name] = _load_evaluate(name, f"trainer.val_metrics[{i}]")
        _check_builtin_kwargs(t)
        fn = None
        f, key = t.val_metric_fn, "trainer.val_metric_fn"
        if f.path or f.name:
            try:
                check_import(f.path, f.name, key, f.import_timeout_s, f"{key}.import_timeout_s",
                             check=(check_metric_fn, (key,)))
                if rank == 0:  # the only rank that computes
                    fn = load_user_object(f.path, f.name, key)
            except ValueError as e:  # a user's input: reported like the other config errors
                raise ConfigError(str(e)) from e
        if t.log_val_generations and rank == 0:
            _check_writable_dir(os.path.join(cfg.trainer.run_dir, "val_generations"),
                                "trainer.log_val_generations")
        return cls(list(t.val_metrics), {k: dict(v) for k, v in t.val_metric_kwargs.items()},
                   float(t.val_pass_threshold), cfg.rollout.val_n, t.log_val_generations, fn, modules,
                   float(f.timeout_s))

    def report(self, samples: Optional[ValSamples], step: int, run_dir: str) -> dict[str, float]:
        """Rank 0 (which holds `samples`; the others pass None) computes the metrics and writes
        the generations file; every rank returns the same metrics, or raises ValMetricError."""
        payload: list = [None]
        if dist.get_rank() == 0:
            try:
                payload[0] = ("ok", self.compute(samples))
                if self.num_generations:
                    write_generations(samples, step, run_dir, self.num_generations)
            except Exception as e:  # noqa: BLE001 - every rank raises it below
                # The other ranks get the message only: the traceback (the user's file and line)
                # goes to rank 0's log.
                log.error("validation at step %d failed:\n%s", step, traceback.format_exc())
                payload[0] = ("error", f"validation at step {step}: {type(e).__name__}: {e}")
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        status, value = payload[0]
        if status == "error":
            raise ValMetricError(value)
        return value

    def compute(self, s: ValSamples) -> dict[str, float]:
        out: dict[str, float] = {}
        for source in dict.fromkeys(s.sources):  # first-seen order
            idx = [i for i, src in enumerate(s.sources) if src == source]
            out.update({f"val/{source}/{k}": v for k, v in self._source_metrics(s, idx).items()})
        return out

    def _source_metrics(self, s: ValSamples, idx: list[int]) -> dict[str, float]:
        n = self.n
        scores = [s.scores[i] for i in idx]
        best: dict[int, float] = {}  # group -> its best sample's score
        for i in idx:
            best[s.groups[i]] = max(best.get(s.groups[i], -math.inf), s.scores[i])
        out = {f"score/mean@{n}": sum(scores) / len(scores),
               f"pass@{n}": sum(b >= self.pass_threshold for b in best.values()) / len(best)}
        for name, values in s.extras.items():
            mine = [values[i] for i in idx if values[i] is not None]
            if mine:
                out[f"reward/{name}/mean"] = sum(mine) / len(mine)
        responses = [s.responses[i] for i in idx]
        references = [reference_of(s.rows[i]) for i in idx]
        if self.names:
            out["no_reference"] = float(sum(r is None for r in references))
            have = [(r, ref) for r, ref in zip(responses, references) if ref is not None]
            if have:
                out.update(self._text_metrics([r for r, _ in have], [ref for _, ref in have]))
        if self.fn is not None:
            mine = _checked_user_metrics(self._call_fn(responses, references, [s.rows[i] for i in idx]))
            taken = sorted(set(mine) & set(out))
            if taken:  # a user's number must not pass for ours
                raise ValueError(f"trainer.val_metric_fn returned {taken}: the built-in metrics "
                                 f"of validation have those names; rename them")
            out.update(mine)
        return out

    def _call_fn(self, responses, references, rows):
        """The user's function under trainer.val_metric_fn.timeout_s: one that blocks fails the
        validation naming itself and where it was (its thread is left behind: Python cannot stop
        it) instead of every rank waiting on rank 0 forever."""
        return call_with_time_limit(
            functools.partial(self.fn, responses, references, rows), self.fn_timeout_s,
            lambda where: (f"trainer.val_metric_fn did not return within "
                           f"trainer.val_metric_fn.timeout_s={self.fn_timeout_s} s; it was here "
                           f"(most recent call last):\n{where}"), "val_metric_fn")

    def _text_metrics(self, responses: list[str], references: list[str]) -> dict[str, float]:
        out = {}
        for name in self.names:
            kw = self.kwargs.get(name, {})
            if name == "exact_match":
                out[name] = exact_match(responses, references)
            elif name == "rouge":
                out.update(rouge(responses, references, **kw))
            elif name == "bleu":
                out[name] = bleu(responses, references, **kw)
            else:
                result = self.evaluate_modules[name].compute(predictions=responses,
                                                             references=references, **kw)
                out.update(evaluate_numbers(name, result))
        return out


def _check_builtin_kwargs(t) -> None:
    """trainer.val_metric_kwargs of rouge and bleu, tried on one pair now: a keyword the
    scorer does not take fails before any model is built, not at the first validation."""
    for name in ("rouge", "bleu"):
        if name in t.val_metrics and t.val_metric_kwargs.get(name):
            try:
                (rouge if name == "rouge" else bleu)(["a b"], ["a b"], **dict(t.val_metric_kwargs[name]))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"trainer.val_metric_kwargs.{name}={dict(t.val_metric_kwargs[name])}"
                                  f": {type(e).__name__}: {e}") from e


def _check_writable_dir(directory: str, key: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{key}: cannot create {directory} ({type(e).__name__}: {e})") from e
    if not os.access(directory, os.W_OK):
        raise ConfigError(f"{key}: {directory} is not writable")


def _load_evaluate(name: str, key: str):
    import evaluate  # optional: only metrics that are not built in need it

    try:
        return evaluate.load(name)
    except Exception as e:  # noqa: BLE001 - evaluate raises many kinds for an unknown name
        cached = _cached_evaluate_modules()
        raise ConfigError(
            f"{key}={name!r} is not a built-in metric ({', '.join(BUILTIN_VAL_METRICS)}) and "
            f"evaluate.load({name!r}) failed: {type(e).__name__}: {e}. Metrics evaluate has "
            f"cached here: {cached or 'none'} (others need network once, or HF_EVALUATE_OFFLINE "
            f"unset); a metric's own packages must be installed too") from e


def _checked_user_metrics(result: Any) -> dict[str, float]:
    key = "trainer.val_metric_fn"
    if not isinstance(result, dict):
        raise ValueError(f"{key} returned {type(result).__name__}, not a dict[str, float]")
    out = {}
    for k, v in result.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"{key} returned the key {k!r}: metric names are non-empty strings")
        if not _is_number(v) or not math.isfinite(float(v)):
            raise ValueError(f"{key} returned {k!r}: {v!r}, not a finite number")
        out[k] = float(v)
    return out


def write_generations(s: ValSamples, step: int, run_dir: str, limit: int) -> str:
    """The first `limit` samples as JSON lines in RUN_DIR/val_generations/step_<step>.jsonl."""
    directory = os.path.join(run_dir, "val_generations")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step}.jsonl")
    lines = [json.dumps({"prompt": p, "response": s.responses[i], "score": s.scores[i],
                         "reference": reference_of(s.rows[i]), "data_source": s.sources[i]})
             for i, p in enumerate(s.prompts[:limit])]
    write_text_atomic(path, "".join(line + "\n" for line in lines))
    return path
