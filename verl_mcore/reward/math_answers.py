"""MATH-style final answers: the content of the last `\\boxed{...}`, normalised, then compared.

Normalisation (both sides): LaTeX spacing and sizing (`\\left`, `\\!`, `\\,`), `$`, degrees, `%`,
`\\text{...}` / `\\mbox{...}` wrappers, a trailing unit (`5 \\text{ cm}`, `12 square feet`,
`3 dollars` -> the number; only words from _UNIT_WORDS, so `2 and 3` or `3 \\text{ or } 4` stay
whole and match neither 2 nor 3), `\\dfrac` / `\\tfrac` -> `\\frac`, short forms `\\frac12` /
`\\sqrt2`, `a/b` -> `\\frac{a}{b}`, thousands separators (`1,000`), a leading `x =`, all spaces, a
trailing period. Two answers are equal if their normalised strings are, or if both are numbers
(integers, decimals, simple fractions) of equal value. Units are dropped on both sides without
being compared: `5 cm` matches `5 m` and `5 km`, as in verl.

verl's MATH scorer (`math_reward`, the Hendrycks normalisation) differs on purpose where it is
either too strict or wrong:
- we accept, verl does not: equal values written differently (`0.75` / `\\frac34`, `-0.5` /
  `-\\frac12`, `\\frac24` / `\\frac12`, `1,000` / `1000`, `5.` / `5`; verl equates only `0.5` with
  `\\frac12`), `\\text{(B)}` for `(B)`, units as plain words or in `\\mbox{}` (verl drops only a
  `\\text{ ...}` with a leading space), bare `%` and `$`, `°`, `\\fbox{}` (verl's fallback to it
  trips over its own assertion and scores 0), a ground truth that is a number or a boxed solution.
- verl accepts, we do not: verl cuts an answer at its first `\\text{ `, so `2 \\text{ and } 3`
  scores as 2 (a false positive); we drop only known units, so `12 \\text{ apples}` is not 12 here.
- `\\boxed 5` (no braces): verl reads from the last `\\boxed ` to the next `$` even if a
  `\\boxed{}` comes later; we take the last box by position and stop at `$` or the end of the line.
- `x = 5` -> `5` for one letter before `=` (verl: up to two characters, `ab = 5` too).
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def brace_group(text: str, open_at: int) -> Optional[str]:
    """Content of the brace group opening at text[open_at] == '{', nested braces included."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
    return None  # unbalanced: the response was cut off


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (or \\fbox{...}, or `\\boxed 5`), or None."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = start + len(cmd)
    if rest < len(text) and text[rest] == "{":
        return brace_group(text, rest)
    if rest < len(text) and text[rest] == " ":
        # TeX would box one token, but `\\boxed 12` means 12; reading on to the end of the math
        # keeps `\\boxed 2 and 3` whole instead of scoring it as 2.
        return re.split(r"[$\n]", text[rest + 1:], maxsplit=1)[0].strip() or None
    return None


def _unwrap(text: str, command: str) -> str:
    """`\\text{abc}` -> ` abc ` for every occurrence of `command` (spaces keep a unit apart
    from the number before it; all spaces go later)."""
    while True:
        at = text.find(command + "{")
        if at < 0:
            return text
        inner = brace_group(text, at + len(command))
        if inner is None:
            return text
        text = text[:at] + " " + inner + " " + text[at + len(command) + len(inner) + 2:]


def _short_fracs(text: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{x} -> \\frac{1}{x}, \\sqrt2 -> \\sqrt{2}."""
    text = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)
    text = re.sub(r"\\frac(\w)(\w)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac(\w)\{", r"\\frac{\1}{", text)
    return re.sub(r"\\frac\{([^{}]*)\}(\w)", r"\\frac{\1}{\2}", text)


# Units and counted things that MATH answers carry after the value (Minerva's list plus common
# units), each optionally plural. A closed list: any other word after a number ("and", "or",
# "more", "apples") keeps the answer whole, so it cannot be reduced to its first number.
_UNIT_WORDS = (
    "mm", "cm", "km", "millimeter", "centimeter", "kilometer", "meter", "metre", "inch", "foot",
    "feet", "ft", "yard", "yd", "mile", "square", "sq", "cubic", "cu", "liter", "litre", "ml",
    "gallon", "quart", "pint", "cup", "mg", "gram", "gm", "kg", "pound", "lb", "ounce", "oz", "ton",
    "second", "sec", "minute", "min", "hour", "hr", "day", "week", "month", "year", "yr", "mph",
    "kph", "per", "dollar", "cent", "degree", "radian", "percent", "unit", "way", "point",
    "integer", "digit", "edge", "student", "meal", "multiple")
# Not part of a longer word or a command (`Tuesday`, `\\min`); one-letter units (m, s, g) are left
# out because they read as variables. An exponent may follow (`cm^2`).
_UNIT = r"(?<![A-Za-z\\])(?:" + "|".join(_UNIT_WORDS) + r")(?:e?s)?(?![A-Za-z])"
_TRAILING_UNITS = re.compile(r"(?:\s*" + _UNIT + r")+\s*(?:\^\{?[23]\}?)?\s*\.?$")


def normalize(answer: str) -> str:
    s = answer.strip().replace("\n", "")
    for old, new in [("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""),
                     ("\\right", ""), ("\\!", ""), ("\\,", " "), ("\\;", " "), ("\\:", " "),
                     ("^{\\circ}", ""), ("^\\circ", ""), ("°", ""), ("\\$", ""), ("$", ""),
                     ("\\%", ""), ("%", ""), ("\\displaystyle", "")]:
        s = s.replace(old, new)
    for command in ("\\text", "\\textbf", "\\mbox", "\\mathrm"):
        s = _unwrap(s, command)
    s = s.strip()
    s = _TRAILING_UNITS.sub("", s).strip() or s  # a unit alone stays what it is
    if re.fullmatch(r"[a-zA-Z]\s*=.*", s):  # "x = 5" -> "5"
        s = s.split("=", 1)[1]
    s = s.replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = _short_fracs(s)
    simple = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if simple:
        s = f"\\frac{{{simple.group(1)}}}{{{simple.group(2)}}}"
    while len(s) >= 2 and s[0] == "{" and brace_group(s, 0) == s[1:-1]:
        s = s[1:-1]
    if s.startswith("."):
        s = "0" + s
    return s


def _number(s: str) -> Optional[Fraction]:
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s)
    try:
        if frac:
            value = Fraction(frac.group(2)) / Fraction(frac.group(3))
            return -value if frac.group(1) else value
        if re.fullmatch(r"-?\d+(\.\d+)?", s):
            return Fraction(s)
    except ZeroDivisionError:
        return None
    return None


def is_equivalent(a: str, b: str) -> bool:
    na, nb = normalize(a), normalize(b)
    if na == nb:
        return True
    va, vb = _number(na), _number(nb)
    return va is not None and va == vb


def compute_score(response: str, ground_truth) -> float:
    """1.0 if the last \\boxed answer equals the ground truth (itself boxed or plain), else 0.0."""
    answer = last_boxed(response)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return 1.0 if is_equivalent(answer, truth) else 0.0
