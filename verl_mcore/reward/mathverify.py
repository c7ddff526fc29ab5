"""MATH answers checked by math-verify (Hugging Face's maintained checker, used by TRL and open-r1):
reward.math_compat=math_verify for the MATH sources.

The check is verl 0.9.1's reward_score/math_verify.py: the ground truth is wrapped in `\\boxed{}` and
parsed as LaTeX, the response is parsed for LaTeX and plain expressions, and the score is 1.0 if
math-verify finds any parsed prediction equal to a parsed ground truth (symbolically or
numerically), else 0.0; an error in parsing or comparing scores 0.0, and a ground truth that is
not a string raises (in verl too).

math-verify bounds each parse and each comparison with signal.alarm, which works only in a
process's main thread. Scoring workers (reward.num_workers >= 1) and the trainer call scorers there,
so its limits (5 s each) hold, under reward.timeout_s; in another thread (a user's code calling
compute_score from a thread pool) they are off, and only reward.timeout_s bounds a call.

math-verify is an optional dependency: `pip install verl_mcore[math]` (or `pip install math-verify`).
"""
from __future__ import annotations

import threading
from typing import Any

PACKAGE = "math-verify"
INSTALL = "pip install 'verl_mcore[math]' (or pip install math-verify)"


def require() -> None:
    """Import math-verify now, or raise ImportError naming the package and the config key."""
    try:
        import math_verify  # noqa: F401  (optional: only reward.math_compat=math_verify needs it)
    except ImportError as e:
        raise ImportError(f"reward.math_compat=math_verify needs the {PACKAGE} package, which is "
                          f"not installed: {INSTALL}; or set reward.math_compat to verl or "
                          f"lenient") from e


def compute_score(response: str, ground_truth: Any) -> float:
    """1.0 if math-verify finds the response's answer equal to the ground truth, else 0.0."""
    require()
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth {ground_truth!r} is a {type(ground_truth).__name__}: "
                        "verl's math_verify scorer needs a string (it raises here too); store "
                        "the ground truths as strings, or set reward.math_compat=lenient")
    # signal.alarm only in the main thread; elsewhere math-verify raises unless its limits are off
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse("\\boxed{" + ground_truth + "}", (LatexExtractionConfig(),),
                 parsing_timeout=limit)
    preds = parse(response, (ExprExtractionConfig(), LatexExtractionConfig()),
                  parsing_timeout=limit)
    if not gold or not preds:
        return 0.0
    return 1.0 if any(verify(g, p, timeout_seconds=limit) for p in preds for g in gold) else 0.0
