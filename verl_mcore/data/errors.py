"""The one error type of the data package, and the record of a skipped row.

Every problem found in the user's files is reported as a `DataError` whose message names the file,
and where they apply the row (0-based, counted from the start of that file) and the column, so
the user can open the file and look.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def where(path: str, row: Optional[int] = None, column: Optional[str] = None) -> str:
    """'data/train.parquet, row 7, column 'prompt'' — the location prefix of every message."""
    parts = [str(path)]
    if row is not None:
        parts.append(f"row {row}")
    if column is not None:
        parts.append(f"column {column!r}")
    return ", ".join(parts)


class DataError(ValueError):
    """A problem with the user's data files; the message says where and what to do."""

    def __init__(self, path: str, problem: str, row: Optional[int] = None,
                 column: Optional[str] = None):
        self.path, self.row, self.column, self.problem = path, row, column, problem
        super().__init__(f"{where(path, row, column)}: {problem}")


@dataclass(frozen=True)
class BadRow:
    """A row left out under `data.on_bad_row=skip` (kept for the report)."""

    path: str
    row: int
    column: Optional[str]
    problem: str

    def __str__(self) -> str:
        return f"{where(self.path, self.row, self.column)}: {self.problem}"
