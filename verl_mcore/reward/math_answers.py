"""MATH-style final answers: the content of the last `\\boxed{...}`, normalised, then compared.

Normalisation (both sides): LaTeX spacing and sizing (`\\left`, `\\!`, `\\,`), `$`, degrees, `%`,
`\\text{...}` / `\\mbox{...}` wrappers and trailing units (`5 \\text{ cm}` -> `5`), `\\dfrac` /
`\\tfrac` -> `\\frac`, short forms `\\frac12` / `\\sqrt2`, `a/b` -> `\\frac{a}{b}`, thousands
separators (`1,000`), a leading `x =`, all spaces. Two answers are equal if their normalised
strings are, or if both are numbers (integers, decimals, simple fractions) of equal value.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _braced(text: str, open_at: int) -> Optional[str]:
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
        return _braced(text, rest)
    if rest < len(text) and text[rest] == " ":
        return re.split(r"[\s$]", text[rest + 1:], maxsplit=1)[0] or None
    return None


def _unwrap(text: str, command: str) -> str:
    """`\\text{abc}` -> ` abc ` for every occurrence of `command` (spaces keep a unit apart
    from the number before it; all spaces go later)."""
    while True:
        at = text.find(command + "{")
        if at < 0:
            return text
        inner = _braced(text, at + len(command))
        if inner is None:
            return text
        text = text[:at] + " " + inner + " " + text[at + len(command) + len(inner) + 2:]


def _short_fracs(text: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{x} -> \\frac{1}{x}, \\sqrt2 -> \\sqrt{2}."""
    text = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)
    text = re.sub(r"\\frac(\w)(\w)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac(\w)\{", r"\\frac{\1}{", text)
    return re.sub(r"\\frac\{([^{}]*)\}(\w)", r"\\frac{\1}{\2}", text)


# A number, a space, then a word of 2+ letters: "5 cm", "12 square inches" ("2x" stays).
_NUMBER_WITH_UNITS = re.compile(r"^(-?[0-9.,]*[0-9])\s+[a-zA-Z]{2,}[a-zA-Z .^0-9]*$")


def normalize(answer: str) -> str:
    s = answer.strip().replace("\n", "")
    for old, new in [("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""),
                     ("\\right", ""), ("\\!", ""), ("\\,", " "), ("\\;", " "), ("\\:", " "),
                     ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""), ("$", ""), ("\\%", ""),
                     ("%", ""), ("\\displaystyle", "")]:
        s = s.replace(old, new)
    for command in ("\\text", "\\textbf", "\\mbox", "\\mathrm"):
        s = _unwrap(s, command)
    s = s.strip()
    units = _NUMBER_WITH_UNITS.match(s)
    if units:
        s = units.group(1)
    if re.fullmatch(r"[a-zA-Z]\s*=.*", s):  # "x = 5" -> "5"
        s = s.split("=", 1)[1]
    s = s.replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = _short_fracs(s)
    simple = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if simple:
        s = f"\\frac{{{simple.group(1)}}}{{{simple.group(2)}}}"
    while len(s) >= 2 and s[0] == "{" and _braced(s, 0) == s[1:-1]:
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
