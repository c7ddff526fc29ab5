"""DAPO-style math answers, with the semantics of verl's `math_dapo` scorer (verl 0.9.1).

Only the last 300 characters of the response count (verl cuts there for speed: MATH-500's
longest answer has 159). The answer is the rest of the line after the last `Answer:` there (any
case, spaces around the colon allowed); both it and the ground truth get the Minerva
normalisation below and must then be equal strings. Without an `Answer:` line, the content of
the last `\\boxed{...}` in the final 100 of those characters is the answer, compared with the
ground truth as strict_box_verify compares it (unnormalised); with neither, the answer is
`[INVALID]`, i.e. wrong. (Older verl, e.g. commit 012542c, had no box fallback: a box without an
`Answer:` line was wrong there.)

Returns {"score": 1.0 or -1.0, "acc": True/False, "pred": the normalised answer}. The reward
manager keeps `acc` as a 1.0/0.0 metric; `pred`, a string, is not logged.

Minerva normalisation (Lewkowycz et al. 2022): keep what follows the last `=`; drop the words
"a " and "an ", `\\$`, every space, `\\ `, a list of units and filler words (cm, feet, dollars,
ways, degrees, `^\\circ`, `\\text{}`...); turn `\\text{and}` into a comma and `\\mbox` into
`\\text`; of `... $x$ ...` keep the first math span; unwrap `\\text{}`, `\\textbf{}`,
`\\overline{}`, `\\boxed{}`; expand `\\frac12` and `\\sqrt2`; drop `$`; drop the commas of a
string of digits and commas (`1,000`; lenient: see below). Being verl's, these quirks are kept on
purpose: words are removed as substrings (`"kmph"` -> `"k"`), `Answer: $2$ and $3$` counts as
`2` (the first span) and `Answer: x = 2 or x = 3` as `3` (after the last `=`; a hedge earns only
what its one scored candidate earns alone), `1/2` and `\\frac{1}{2}` differ, and `-1,000` keeps
its comma.

strict_box_verify: the content of the last `\\boxed{...}` in the final 100 of those 300 characters,
compared unnormalised with the ground truth (pred is None when there is no box).

reward.math_compat=verl (and math_verify, which changes only the MATH sources) is verl 0.9.1's
scorer exactly, with one exception: verl's `pause_tokens_index` (a window before pause tokens) is
not taken. A ground truth that is not a string raises there, as in verl (with a message saying so).

Where math_compat=lenient differs from verl (each is a case of tests/reward/verl_cases.json):
- thousands: only the commas of a number in thousands are dropped (`1,000`); verl drops the commas
  of any string of digits and commas, so `3, 4` and `3,4` equal `34` there (a false positive)
  and `1,000,00` equals `100000`.
- any-ground-truth: the ground truth may be any value and is compared as str() (verl raises on a
  number).
"""
from __future__ import annotations

import re
from typing import Any, Optional

from verl_mcore.reward.math_answers import brace_group

TAIL_CHARS = 300
BOX_TAIL_CHARS = 100
NO_ANSWER = "[INVALID]"

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Applied in this order: "an " goes before "a " can eat its tail, and spaces go before the
# `\text{and}` forms are matched without them.
_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
             ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","),
             ("\\text{m}", "\\text{}"))
# Removed as substrings, in this order (the order decides overlaps such as "kmph").
_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
            "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm",
            "gm", "pounds", "meters", "meals", "edges", "students", "childrentickets",
            "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
            "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!",
            "{,}", '"', "\\dots")


def normalize(answer: str, compat: str = "verl") -> str:
    s = answer.split("=")[-1]
    for old, new in _REPLACED:
        s = s.replace(old, new)
    for word in _REMOVED:
        s = s.replace(word, "")
    s = re.sub(r".*?\$(.*?)\$.*", r"$\1$", s)  # prose around a math span: keep the first span
    for command in ("text", "textbf", "overline"):
        s = re.sub(r"\\" + command + r"\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\boxed\{(.*)\}", r"\1", s)
    s = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", s)
    s = re.sub(r"sqrt([^{])", r"sqrt{\1}", s)
    s = s.replace("$", "")
    if (s.replace(",", "").isdigit() if compat != "lenient"
            else re.fullmatch(r"\d{1,3}(,\d{3})+", s)):
        s = s.replace(",", "")
    return s.strip()


def _last_braced_box(text: str) -> Optional[str]:
    at = text.rfind("\\boxed{")
    return None if at < 0 else brace_group(text, at + len("\\boxed"))


def compute_score(response: str, ground_truth: Any, strict_box_verify: bool = False,
                  compat: str = "verl") -> dict:
    """{"score": 1.0 if the answer matches else -1.0, "acc": bool, "pred": str or None};
    `compat` is reward.math_compat."""
    tail = response[-TAIL_CHARS:]
    if compat != "lenient" and not strict_box_verify and not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth {ground_truth!r} is a {type(ground_truth).__name__}: verl's "
                        "math_dapo scorer needs a string (it raises here too); store the ground "
                        "truths as strings, or set reward.math_compat=lenient")
    truth = str(ground_truth) if compat == "lenient" else ground_truth
    if strict_box_verify:
        pred = _last_braced_box(tail[-BOX_TAIL_CHARS:])
        correct = pred == truth
    else:
        lines = _ANSWER_LINE.findall(tail)
        pred = normalize(lines[-1] if lines else NO_ANSWER, compat)
        correct = pred == normalize(truth, compat)
        box = _last_braced_box(tail[-BOX_TAIL_CHARS:]) if pred == NO_ANSWER else None
        if box is not None:  # verl 0.9.1's fallback: no `Answer:` line, the last box
            pred, correct = box, box == truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
