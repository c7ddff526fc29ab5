"""GSM8K: the answer is the number after `####` (the dataset's own format).

strict    the number after the last `#### ` in the response; nothing else counts
flexible  the last number anywhere in the response (for models that do not follow the format)

Numbers compare by value: `1,000`, `$1000`, `1000.00` and `1000` are the same answer.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_NUMBER = r"-?\$?\s*[0-9][0-9,]*(?:\.[0-9]+)?|-?\$?\s*\.[0-9]+"
_AFTER_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def _value(text: str) -> Optional[Fraction]:
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(response: str, method: str = "strict") -> Optional[str]:
    """The answer string the response commits to, or None (see the module docstring)."""
    if method == "strict":
        found = _AFTER_HASHES.findall(response)
    elif method == "flexible":
        found = _ANY_NUMBER.findall(response)
    else:
        raise ValueError(f"method={method!r}: 'strict' or 'flexible'")
    return found[-1].strip() if found else None


def compute_score(response: str, ground_truth, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` for the right number, `format_score` for a wrong one, 0 for no answer."""
    answer = extract_answer(response, method)
    if answer is None:
        return 0.0
    got, want = _value(answer), _value(str(ground_truth))
    if got is not None and want is not None:
        return score if got == want else format_score
    return score if answer == str(ground_truth).strip() else format_score
