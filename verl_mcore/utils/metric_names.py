"""Metric-name fragments made from text users choose (a reward route's value, a group filter's
reason): the text itself when it is a safe name, else a safe name that stays unique."""
from __future__ import annotations

import hashlib
import re

_SAFE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def name_fragment(value: str) -> str:
    """`value` when it is 1-64 of [A-Za-z0-9_.-]; otherwise its first 48 characters with every
    other character replaced by "_", then "-" and 8 hex digits of its SHA-1, so that two values
    never share a name ("C++" -> "C__-<hash>", "a/b" -> no "/" that would nest the metric)."""
    if _SAFE.fullmatch(value):
        return value
    digest = hashlib.sha1(value.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", value[:48]) + "-" + digest
