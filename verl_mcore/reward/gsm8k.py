"""GSM8K: the answer is the number after `#### ` (the dataset's own format).

strict    the number right after the last `#### ` (four hashes and one space, as verl's regex:
          `####72` and `####  72` are not the format); nothing else counts
flexible  the last number anywhere in the response (for models that do not follow the format)

`score` for the right answer, `format_score` for a wrong one, 0 for none. Two semantics
(reward.math_compat):

verl      verl 0.9.1's gsm8k scorer, exactly: only the response's last 300 characters are read
          (the cut can fall inside the answer); a number is a run of digits, `.` and `,`, with an
          optional `-` before it; strict drops the commas of its answer, flexible keeps them and
          skips a lone `.`; the answer must then equal the ground truth as a string (`18.00` is
          not 18, and an int ground truth never matches).
lenient   a number is digits with `.` and `,` inside, optionally `-` and `$` before it, ending on a
          digit; numbers compare by value; commas count only as thousands separators. An answer
          that is no number (`1.2.3`) compares as text.

Where lenient differs from verl (each is a case of tests/reward/verl_cases.json):
- value: numbers compare by value, so `#### 3.50` is 3.5, `#### 00072` and `#### 72.0` are 72,
  `#### 0.5` is `.5`, and an int ground truth (72) or one with spaces (` 72`) matches `#### 72`;
  verl compares strings.
- dollar: a `$` before the number is allowed (`#### $72`, `#### -$5`); verl needs a digit, `-`, `.`
  or `,` right after `#### `.
- trailing-period: the number ends on a digit, so `#### 72.` and (flexible) `the answer is 72.`
  are 72; verl keeps the final `.`.
- commas: commas count only as thousands separators: `#### 4,5` is not 45 (verl's strict drops
  every comma), and flexible reads `1,000` as 1000 (verl's flexible keeps the comma).
- no-number: flexible gives 0 to a response without a digit; verl takes a lone `.` or `,` for an
  answer and gives it format_score.
- whole-response: the whole response is read, so `#### 72` followed by more than 300 characters
  of text is right; verl reads only the last 300.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

# Ends on a digit, so a sentence's full stop or comma is not part of the number.
_NUMBER = r"-?\$?[0-9.,]*[0-9]"
_AFTER_HASHES = re.compile(r"#### (" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)

VERL_TAIL_CHARS = 300  # verl reads only the end of a response (regex speed)
_VERL_NUMBER = r"-?[0-9.,]+"
_VERL_AFTER_HASHES = re.compile(r"#### (" + _VERL_NUMBER + ")")
_VERL_ANY_NUMBER = re.compile(_VERL_NUMBER)


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


def _check_method(method: str) -> None:
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r}: 'strict' or 'flexible'")


def extract_answer(response: str, method: str = "strict", compat: str = "verl") -> Optional[str]:
    """The answer string the response commits to, or None (see the module docstring)."""
    _check_method(method)
    if compat == "verl":
        tail = response[-VERL_TAIL_CHARS:]
        if method == "strict":
            found = _VERL_AFTER_HASHES.findall(tail)
            return found[-1].replace(",", "") if found else None
        found = _VERL_ANY_NUMBER.findall(tail)
        # The last one that is not a lone "."; when every one is, verl's loop ends on the first.
        return next((f for f in reversed(found) if f != "."), found[0] if found else None)
    found = (_AFTER_HASHES if method == "strict" else _ANY_NUMBER).findall(response)
    return found[-1].strip() if found else None


def compute_score(response: str, ground_truth, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0, compat: str = "verl") -> float:
    """`score` for the right number, `format_score` for a wrong one, 0 for no answer; `compat` is
    reward.math_compat ("math_verify" scores GSM8K as "verl": the `####` format is the reward)."""
    answer = extract_answer(response, method, "lenient" if compat == "lenient" else "verl")
    if answer is None:
        return 0.0
    if compat != "lenient":
        return score if answer == ground_truth else format_score
    got, want = _value(answer), _value(str(ground_truth))
    if got is not None and want is not None:
        return score if got == want else format_score
    return score if answer == str(ground_truth).strip() else format_score
