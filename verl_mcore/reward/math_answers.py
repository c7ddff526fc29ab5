"""MATH-style final answers: the content of the last `\\boxed{...}`, normalised, then compared.

Lenient normalisation (both sides): LaTeX spacing and sizing (`\\left`, `\\!`, `\\,`), `$`, degrees, `%`,
`\\text{...}` / `\\mbox{...}` wrappers, a trailing unit (`5 \\text{ cm}`, `12 square feet`,
`3 dollars` -> the number; only words from _UNIT_WORDS, so `2 and 3` or `3 \\text{ or } 4` stay
whole and match neither 2 nor 3), `\\dfrac` / `\\tfrac` -> `\\frac`, short forms `\\frac12` /
`\\sqrt2`, `a/b` -> `\\frac{a}{b}`, thousands separators (`1,000`), a leading `x =`, all spaces, a
trailing period. Two answers are equal if their normalised strings are, or if both are numbers
(integers, decimals, simple fractions) of equal value. Units are dropped on both sides without
being compared: `5 cm` matches `5 m` and `5 km`, as in verl.

Two semantics (reward.math_compat; `math_verify` scores these sources with math_verify.py):

verl      verl 0.9.1's math_reward (the Hendrycks MATH normalisation), exactly: the last
          `\\boxed{}` (or, anywhere in the response, the text after the last `\\boxed ` up to a
          `$`); `\\fbox{}` and `\\boxed\\frac..` give no answer; both sides lose `\\!`, `\\left`,
          `\\right`, degrees, `\\$`, `\\%`, spaces and what follows a `\\text{ ` (a unit), get
          `\\dfrac` -> `\\frac`, `\\frac12` -> `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`, `0.5` and
          `1/2` -> `\\frac{1}{2}`, `k = 5` -> `5` (up to two characters before `=`), and must then
          be equal strings; where that normalisation fails (two `\\text{ `, a bare `\\frac`) the
          raw strings are compared. A ground truth that is not a string never matches.
lenient   the normalisation above this section.

Where lenient differs from verl (each is a case of tests/reward/verl_cases.json):
- value: numbers compare by value: `0.75` / `\\frac34`, `-0.5` / `-\\frac12`, `\\frac24` /
  `\\frac12`, `033` / `33`, `000` / `0`, `-0` / `0`, `\\$1.50` / `\\$1.5`; verl equates only
  `0.5` with `\\frac12`.
- period: a trailing period is dropped (`5.` is 5).
- math-dollar: a bare `$` is dropped, so math mode inside the box (`\\boxed{$5$}`) is 5; verl drops
  only `\\$`.
- braces: braces around the whole answer are dropped (`{5}` is 5).
- short-frac: `\\frac{10}3` and `\\frac{\\pi}2` are `\\frac{10}{3}` and `\\frac{\\pi}{2}`; verl expands
  only a first argument without braces (`\\frac12`, `\\frac1{x}`).
- text: `\\text{}`, `\\textbf{}`, `\\mbox{}` and `\\mathrm{}` wrappers are dropped on both sides, so
  `(C)` is `\\text{(C)}`, `\\textbf{(C)}` is `\\text{(C)}` and `Tuesday` is `\\text{Tuesday}`; verl
  keeps them.
- units: units as plain words or in `\\mbox{}` / `\\text{5 inches}` are dropped (`12 square
  inches`, `18 dollars`, `12\\mbox{ inches}`); verl drops only what follows `\\text{ `.
- unit-words: after `\\text{ ` only known unit words are dropped, so `2 \\text{ and } 3`, `3 \\text{ or
  } 4`, `5 \\text{ or more}`, `12 \\text{ apples}` and `5 \\text{ m}` are not 2, 3, 5, 12 and 5
  here (verl cuts at the first `\\text{ `: a false positive for the first three).
- thousands: thousands separators and LaTeX spacing are dropped (`10,000`, `\\$1,000`, `1\\,000`
  are 10000 and 1000); verl keeps commas and `\\,`.
- percent: a bare `%` is dropped like `\\%`.
- box-position: the last box by position counts: `\\boxed 7, and later \\boxed{3}` is 3 (verl: a
  `\\boxed ` anywhere wins over every `\\boxed{}`).
- fbox: `\\fbox{7}` is read like `\\boxed{7}` (verl's fallback to it fails its own assertion).
- ground-truth: a ground truth that is a number (int 5), a boxed solution (`\\boxed{5}`) or a math
  span (`$5$`) is read as its answer; verl compares it as it is.
- equals: `x = 5` -> `5` for one letter before `=`, spaces allowed; verl takes up to two
  characters without counting them out (`ab=5` is 5 there, `ab = 5` is not).
- boxed-space: `\\boxed 5` stops at `$` or the end of the line; verl reads on to the next `$`.
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


def compute_score(response: str, ground_truth, compat: str = "verl") -> float:
    """1.0 if the last \\boxed answer equals the ground truth, else 0.0; `compat` is
    reward.math_compat: "verl" (verl_score) or "lenient" (ground truth itself boxed or plain)."""
    if compat == "verl":
        return verl_score(response, ground_truth)
    if compat != "lenient":
        raise ValueError(f"compat={compat!r}: 'verl' or 'lenient' (math-verify: math_verify.py)")
    answer = last_boxed(response)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return 1.0 if is_equivalent(answer, truth) else 0.0


# ---- verl 0.9.1's math_reward (the Hendrycks MATH normalisation), step by step ---------------

class _Unnormalisable(Exception):
    """Where verl's normalisation raises (an assertion or an index out of range): verl then
    compares the two answers as they are."""


def _verl_box(response: str) -> Optional[str]:
    """The answer verl reads, or None (no box, an unclosed one, or one it cannot unwrap)."""
    if "\\boxed " in response:  # wins over any \\boxed{}; ends at the next `$`
        return response.split("\\boxed ")[-1].split("$")[0]
    start = response.rfind("\\boxed")
    if start < 0:
        start = response.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(response)):
        depth += {"{": 1, "}": -1}.get(response[i], 0)
        if response[i] == "}" and depth == 0:
            box = response[start:i + 1]
            # Only `\\boxed{...}` unwraps: `\\fbox{5}` and `\\boxed\\frac{1}{2}` fail verl's assertion
            return box[len("\\boxed{"):-1] if box.startswith("\\boxed{") else None
    return None


def _verl_sqrt(s: str) -> str:
    head, *rest = s.split("\\sqrt")
    for piece in rest:
        if not piece:
            raise _Unnormalisable
        head += "\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:])
    return head


def _verl_fracs(s: str) -> str:
    head, *rest = s.split("\\frac")
    for piece in rest:
        if not piece:
            raise _Unnormalisable
        if piece[0] == "{":
            head += "\\frac" + piece
        elif len(piece) < 2:
            return s  # verl gives up on the whole string
        elif piece[1] == "{":
            head += "\\frac{" + piece[0] + "}" + piece[1:]
        else:
            head += "\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:]
    return head


def _verl_slash(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def verl_normalize(s: str) -> str:
    """verl's strip_string; raises _Unnormalisable where verl's raises."""
    for old, new in [("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""),
                     ("\\$", "")]:
        s = s.replace(old, new)
    if "\\text{ " in s:  # a unit: verl keeps what comes before it, if it is the only one
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            raise _Unnormalisable
        s = parts[0]
    for old, new in [("\\\\%", ""), ("\\%", ""), (" .", " 0."), ("{.", "{0.")]:
        s = s.replace(old, new)
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `k = 5`, `ab= 5`
        s = sides[1]
    if "\\sqrt" in s:
        s = _verl_sqrt(s)
    s = _verl_fracs(s.replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _verl_slash(s)


def verl_score(response: str, ground_truth) -> float:
    """verl 0.9.1's MATH score: 1.0 if verl_normalize makes the last box's content and the ground
    truth equal strings (or, where it fails on either, they are equal as they are)."""
    answer = _verl_box(response)
    if answer is None or not isinstance(ground_truth, str):  # verl: a str never equals a non-str
        return 0.0
    try:
        return 1.0 if verl_normalize(answer) == verl_normalize(ground_truth) else 0.0
    except _Unnormalisable:
        return 1.0 if answer == ground_truth else 0.0
