"""GSM8K: the answer is the number after `#### ` (the dataset's own format).

strict    the number right after the last `#### ` (four hashes and one space, as verl's regex:
          `####72` and `####  72` are not the format); nothing else counts
flexible  the last number anywhere in the response (for models that do not follow the format)

A number is digits with `.` and `,` inside, optionally `-` and `$` before it. Numbers compare by
value: `1,000`, `$1000`, `1000.00`, `1000.` and `1000` are the same answer; commas count only as
thousands separators, so `4,5` is not 45. An answer that is no number (`1.2.3`) compares as text.

Where verl's gsm8k differs (it compares the extracted string with the ground truth exactly):
`#### 18.00`, `#### 0.5` for `.5`, `#### 72.`, `#### $72` and an int ground truth score as wrong or
unanswered there and right here; verl's flexible mode keeps commas (`1,000` is not 1000 there) and
takes a lone `.` or `,` in the text for an answer (format_score where we give 0 for no number);
its strict mode drops every comma (`#### 4,5` is 45 there and a wrong answer here). verl 0.9.1
reads only the response's last 300 characters (for regex speed; the cut can fall inside the
answer); we read all of it, so `#### 72` followed by more than 300 characters of text is right
here and unanswered there.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

# Ends on a digit, so a sentence's full stop or comma is not part of the number.
_NUMBER = r"-?\$?[0-9.,]*[0-9]"
_AFTER_HASHES = re.compile(r"#### (" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def _value(text: str) -> Optional[Fraction]:
    cleaned = text.replace("$", "")
    if "," in cleaned:
        if not re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", cleaned):
            return None
        cleaned = cleaned.replace(",", "")
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
