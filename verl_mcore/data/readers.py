"""Find data files and read each one into a pyarrow Table.

Formats, recognised by their first bytes (the extension decides only for JSON Lines):
  Parquet           `PAR1`                   pq.read_table, memory-mapped
  Arrow IPC file    `ARROW1` (.arrow/.feather) memory-mapped, zero-copy
  Arrow IPC stream  `0xFFFFFFFF` (.arrows, and the .arrow files of HF `datasets` caches)
                                             memory-mapped, zero-copy
  JSON Lines        .jsonl / .json, one object per line  pyarrow.json, block-wise

No path goes through pandas or Python objects for the whole file, except for JSON Lines files
that pyarrow.json reads wrongly or not at all, which are re-read line by line in Python:
  - a file pyarrow rejects: its message gives a row number relative to an internal block, so the
    line-by-line read finds the real row, and under `on_bad_row=skip` keeps the good rows; it
    also reads a column that is [] or null in the first blocks and objects later;
  - a file where pyarrow inferred a timestamp or date from a string ("2021-03-04"): JSON has no
    date type, and a ground truth must reach the scorer as the string it is.
Every column read is then validated in full (a string that is not UTF-8 is refused here, with
the file and column named, not in some later batch), and view types are cast to plain ones.
"""
from __future__ import annotations

import collections
import glob
import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from verl_mcore.data.errors import BadRow, DataError

DEFAULT_EXTENSIONS = (".parquet", ".arrow", ".arrows", ".feather", ".ipc", ".jsonl", ".json")
_STREAM_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _type_test(name: str):
    """pa.types.<name>, or "never" on a pyarrow too old to have it (the view types: pyarrow 16)."""
    return getattr(pa.types, name, lambda t: False)


_is_string_view, _is_binary_view = _type_test("is_string_view"), _type_test("is_binary_view")


def _is_list_view(t: pa.DataType) -> bool:
    return _type_test("is_list_view")(t) or _type_test("is_large_list_view")(t)


@dataclass
class FileRows:
    """The readable rows of one file.

    `row_numbers[i]` is the file row (0-based) of table row i; None means the identity (no row
    was left out while reading).
    """

    path: str
    table: pa.Table
    row_numbers: Optional[np.ndarray] = None
    bad_rows: list[BadRow] = field(default_factory=list)

    def file_row(self, i: int) -> int:
        return int(i if self.row_numbers is None else self.row_numbers[i])


def resolve_files(spec: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
                  extensions: Sequence[str] = DEFAULT_EXTENSIONS) -> list[str]:
    """One file, a directory (its files with one of `extensions`, not recursive, hidden ones left
    out as a glob leaves them; or a Dataset written by datasets' save_to_disk: its data files), a glob (`data/**/*.parquet`), or a list of any of these -> the
    sorted file list. `~` is expanded; an existing file is used as named even when its name holds
    glob characters (`train[1].parquet`); a file reached under several names (`./a`, a symlink,
    a symlink loop under `**`) is read once, under the first name."""
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not items:
        raise DataError("data files", "no files given (data.train_files / data.val_files is empty)")
    files: list[str] = []
    seen: set[str] = set()  # real paths
    for item in items:
        item = os.path.expanduser(os.fspath(item))
        if os.path.isfile(item):
            found = [item]
        elif os.path.isdir(item) and os.path.isfile(os.path.join(item, _SAVED_DATASET_STATE)):
            found = _saved_dataset_files(item)
        elif os.path.isdir(item) and os.path.isfile(os.path.join(item, _SAVED_DATASET_DICT)):
            splits = sorted(n for n in os.listdir(item) if os.path.isdir(os.path.join(item, n)))
            raise DataError(item, f"a DatasetDict written by datasets' save_to_disk: name one "
                                  f"split's directory ({', '.join(splits) or 'it has none'}), "
                                  f"e.g. {os.path.join(item, splits[0] if splits else 'train')}")
        elif os.path.isdir(item):
            found = sorted(os.path.join(item, n) for n in os.listdir(item)
                           if n.lower().endswith(tuple(extensions)) and not n.startswith(".")
                           and os.path.isfile(os.path.join(item, n)))
            if not found:
                raise DataError(item, f"the directory holds no file ending in {', '.join(extensions)}")
        elif any(ch in item for ch in "*?["):
            # A file reached under several names (a symlink loop under `**`) keeps its shortest.
            shortest: dict[str, str] = {}
            for p in sorted(glob.glob(item, recursive=True), key=len):
                if os.path.isfile(p):
                    shortest.setdefault(os.path.realpath(p), p)
            found = sorted(shortest.values())
            if not found:
                raise DataError(item, "the pattern matches no file")
        else:
            raise DataError(item, "no such file or directory")
        for f in found:
            real = os.path.realpath(f)
            if real not in seen:
                seen.add(real)
                files.append(f)
    return files


_SAVED_DATASET_STATE = "state.json"  # a Dataset written by datasets' save_to_disk
_SAVED_DATASET_DICT = "dataset_dict.json"  # a DatasetDict: one such directory per split


def _saved_dataset_files(directory: str) -> list[str]:
    """The Arrow stream files of a directory written by `datasets.Dataset.save_to_disk`, in the
    order its state.json lists them (its other JSON files are metadata, not rows)."""
    state_path = os.path.join(directory, _SAVED_DATASET_STATE)
    try:
        with open(state_path) as f:
            names = [entry["filename"] for entry in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(state_path, f"looks like datasets' save_to_disk state but does not list "
                                    f"its data files ({type(e).__name__}: {e})") from None
    paths = [os.path.join(directory, os.path.basename(str(n))) for n in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing or not paths:
        raise DataError(state_path, f"lists data files that are missing: {missing}" if missing
                                    else "lists no data files")
    return paths


def detect_format(path: str) -> str:
    """'parquet' | 'arrow_file' | 'arrow_stream' | 'jsonl', from the magic bytes, else the name."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise DataError(path, f"cannot open the file: {e}") from e
    if not head:
        raise DataError(path, "the file is empty (0 bytes)")
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1"):
        return "arrow_file"
    if head.startswith(b"\xff\xff\xff\xff"):
        return "arrow_stream"
    if path.lower().endswith((".jsonl", ".json")):
        if head.lstrip().startswith(b"["):
            raise DataError(path, "a JSON array is not supported: write one JSON object per line "
                                  "(JSON Lines)")
        return "jsonl"
    raise DataError(path, "not a Parquet, Arrow IPC (file or stream) or JSON Lines (.jsonl) file "
                          f"(first bytes {head!r})")


def read_file_rows(path: str, on_bad_row: str = "error", prompt_key: Optional[str] = None,
                   limit: Optional[int] = None) -> FileRows:
    """Read one file of any supported format; every failure is a DataError naming the file.
    `prompt_key` (data.prompt_key) is for the message about a prompt column of mixed kinds.
    `limit`: the first rows only (the preflight's sample, data/checks.check_files): Parquet
    decodes only them, JSON Lines parses only their lines, Arrow maps the file as always."""
    fmt = detect_format(path)
    if fmt == "jsonl":
        return _validated(_read_jsonl_rows(path, on_bad_row, prompt_key, limit) if limit else
                          _read_jsonl(path, on_bad_row, prompt_key))
    readers = {"parquet": _read_parquet, "arrow_file": _read_arrow_file,
               "arrow_stream": _read_arrow_stream}
    try:
        if limit and fmt == "parquet":
            table = _read_parquet_head(path, limit)
        else:  # Arrow is memory-mapped: the slice reads nothing more
            table = readers[fmt](path).slice(0, limit)
    except DataError:
        raise
    except (pa.ArrowException, OSError) as e:
        raise DataError(path, f"cannot read it as {fmt.replace('_', ' ')} (truncated or corrupt?): "
                              f"{e}") from e
    return _validated(FileRows(path, table))


def _validated(part: FileRows) -> FileRows:
    """`part`, after a full check of its data: the readers do not check that strings are UTF-8,
    and a bad one would fail later, in some batch, without the file named."""
    for name, column in zip(part.table.column_names, part.table.columns):
        for chunk in column.chunks:
            try:
                chunk.validate(full=True)
            except pa.ArrowInvalid as e:
                raise DataError(part.path, f"the column holds invalid data (e.g. a string that is "
                                           f"not UTF-8): {e}", column=name) from e
    return part


def _read_parquet(path: str) -> pa.Table:
    return pq.read_table(path, memory_map=True)


def _read_parquet_head(path: str, rows: int) -> pa.Table:
    source = pq.ParquetFile(path, memory_map=True)
    first = next(source.iter_batches(batch_size=rows), None)
    return source.schema_arrow.empty_table() if first is None else pa.Table.from_batches([first])


def _read_arrow_file(path: str) -> pa.Table:
    return ipc.open_file(pa.memory_map(path, "r")).read_all()


def _read_arrow_stream(path: str) -> pa.Table:
    source = pa.memory_map(path, "r")
    table = ipc.open_stream(source).read_all()
    # A stream cut exactly between two record batches reads without error; only the missing
    # end-of-stream marker tells that rows were lost.
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - len(_STREAM_EOS)))
        if f.read() != _STREAM_EOS:
            raise DataError(path, "the Arrow stream has no end-of-stream marker: the file is "
                                  "truncated (or its writer was not closed)")
    return table


def nested_types(t: pa.DataType) -> Iterable[pa.DataType]:
    """`t` and every type nested in it: list items, struct fields, map keys and items,
    dictionary values."""
    yield t
    if pa.types.is_struct(t):
        for f in t:
            yield from nested_types(f.type)
    elif pa.types.is_map(t):
        yield from nested_types(t.key_type)
        yield from nested_types(t.item_type)
    elif hasattr(t, "value_type"):
        yield from nested_types(t.value_type)


def plain_types(path: str, table: pa.Table) -> pa.Table:
    """`table` with string_view / binary_view values (what polars >= 1.0 writes to Arrow IPC) as
    large_string / large_binary, nested ones included: pyarrow's `take` and `group_by` have no
    kernels for the view types. A list_view column is refused (pyarrow's cast of it to a plain
    list gives wrong offsets)."""
    for f in table.schema:
        if any(_is_list_view(t) for t in nested_types(f.type)):
            raise DataError(path, f"the column holds {f.type}; list views are not supported: "
                                  f"write lists as list or large_list", column=f.name)
    schema = pa.schema([f.with_type(_plain_type(f.type)) for f in table.schema],
                       metadata=table.schema.metadata)
    return table if schema.equals(table.schema) else table.cast(schema)


def _plain_type(t: pa.DataType) -> pa.DataType:
    if _is_string_view(t):
        return pa.large_string()
    if _is_binary_view(t):
        return pa.large_binary()
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_plain_type(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(_plain_type(t.key_type), _plain_type(t.item_type))
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_plain_type(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(t.value_field.with_type(_plain_type(t.value_type)))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(_plain_type(t.value_type)), t.list_size)
    if pa.types.is_dictionary(t):
        return pa.dictionary(t.index_type, _plain_type(t.value_type), t.ordered)
    return t


def _has_inferred_dates(schema: pa.Schema) -> bool:
    """pyarrow.json turns strings that look like dates ("2021-03-04") into timestamps, and has no
    option to stop it; JSON has no date type, so any such column was a string in the file."""
    return any(pa.types.is_timestamp(t) or pa.types.is_date(t)
               for f in schema for t in nested_types(f.type))


def _read_jsonl(path: str, on_bad_row: str, prompt_key: Optional[str]) -> FileRows:
    try:
        table = pa_json.read_json(path)
    except pa.ArrowException:
        # ArrowInvalid for a bad line, ArrowNotImplementedError when a column is [] or null in
        # the first blocks and holds objects later: the line-by-line path tells them apart.
        return _read_jsonl_rows(path, on_bad_row, prompt_key)
    if _has_inferred_dates(table.schema):
        # Read again through Python, where a JSON string stays a str (a ground truth
        # "2021-03-04" must reach the scorer as written).
        return _read_jsonl_rows(path, on_bad_row, prompt_key)
    return FileRows(path, table)


def _read_jsonl_rows(path: str, on_bad_row: str, prompt_key: Optional[str],
                     limit: Optional[int] = None) -> FileRows:
    """The file parsed line by line: slow, for the files pyarrow.json reads wrongly or not at
    all. Pyarrow infers each block's types from that block; here the whole file decides (or its
    first `limit` rows)."""
    rows, row_numbers, bad = _scan_jsonl(path, prompt_key, limit)
    if bad and on_bad_row != "skip":
        first = bad[0]
        raise DataError(path, first.problem, first.row, first.column)
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
        skipped = f" left after skipping {len(bad)} bad ones" if bad else ""
        raise DataError(path, f"the rows{skipped} do not form one table: {e}",
                        row_numbers[_first_unconvertible(rows)]) from e
    return FileRows(path, table, np.asarray(row_numbers, dtype=np.int64) if bad else None, bad)


def _first_unconvertible(rows: list[dict]) -> int:
    """The first row i such that rows[:i + 1] no longer form a table, by bisection (for the
    message only; `rows` as a whole do not convert)."""
    def converts(n: int) -> bool:
        try:
            pa.Table.from_pylist(rows[:n])
            return True
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return False

    good, failing = 0, len(rows)  # rows[:good] convert, rows[:failing] do not
    while failing - good > 1:
        mid = (good + failing) // 2
        good, failing = (mid, failing) if converts(mid) else (good, mid)
    return failing - 1


def kind_mismatches(rows: Sequence[object]) -> list[Optional[tuple[str, str, str, str]]]:
    """What pyarrow refuses to put into one column: for each row (a dict; anything else gets
    None), its first value whose kind (string / number / list / object / bool, nested values
    included) differs from the kind most rows have there, as (column, path, kind, usual kind),
    e.g. ("prompt", "prompt", "string", "list"); None when the row agrees with the others.
    Float NaN counts as missing (pandas writes it for a missing value)."""
    def kinds(value) -> list[tuple[str, str]]:
        return [] if isinstance(value, float) and value != value else list(_kinds(value, ""))

    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for value in rows:
        if isinstance(value, dict):
            for key, item in value.items():
                for p, kind in kinds(item):
                    counts[key + p][kind] += 1
    usual = {p: c.most_common(1)[0][0] for p, c in counts.items()}
    found: list[Optional[tuple[str, str, str, str]]] = []
    for value in rows:
        mismatch = None
        if isinstance(value, dict):
            mismatch = next(((key, key + p, kind, usual[key + p]) for key, item in value.items()
                             for p, kind in kinds(item) if kind != usual[key + p]), None)
        found.append(mismatch)
    return found


def mismatch_problem(mismatch: tuple[str, str, str, str], prompt_key: Optional[str],
                     at: str = "") -> str:
    """The message for one of kind_mismatches' findings; `at`: e.g. " (line 4)"."""
    key, path, kind, usual = mismatch
    where_in = "" if path == key else f" at {path}"
    problem = f"{_a(kind)}{where_in}{at} where the other rows have {_a(usual)}"
    if key == prompt_key and path == key and {kind, usual} == {"string", "list"}:
        problem += (f" (data.prompt_key={prompt_key!r}): the prompts of a dataset are all strings "
                    "or all lists of {role, content} messages; write a string prompt s as "
                    "[{\"role\": \"user\", \"content\": s}]")
    return problem


def _kinds(value, path: str) -> Iterable[tuple[str, str]]:
    """(path, kind) for a JSON value and everything nested in it; null fits every kind."""
    if value is None:
        return
    if isinstance(value, bool):
        yield path, "bool"
    elif isinstance(value, (int, float)):
        yield path, "number"
    elif isinstance(value, str):
        yield path, "string"
    elif isinstance(value, (list, tuple, np.ndarray)):  # pandas holds Arrow lists as arrays
        yield path, "list"
        for item in value:
            yield from _kinds(item, path + "[]")
    elif isinstance(value, dict):
        yield path, "object"
        for key, item in value.items():
            yield from _kinds(item, f"{path}.{key}")


def _a(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def _scan_jsonl(path: str, prompt_key: Optional[str] = None, limit: Optional[int] = None
                ) -> tuple[list[dict], list[int], list[BadRow]]:
    """Parse line by line (the first `limit` rows); a row is bad if it is not a JSON object, or
    if some value in it has a different kind from the one most rows have there
    (kind_mismatches). Returns the good rows, their file row numbers, and the bad rows."""
    parsed: list[tuple[int, int, object]] = []  # (row, line, value or exception)
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        row = 0
        for line_no, line in enumerate(f, start=1):
            if row == limit:
                break
            if not line.strip():
                continue
            try:
                parsed.append((row, line_no, json.loads(line)))
            except json.JSONDecodeError as e:
                parsed.append((row, line_no, e))
            row += 1
    mismatches = kind_mismatches([value for _, _, value in parsed])
    rows, row_numbers, bad = [], [], []
    for (row, line_no, value), mismatch in zip(parsed, mismatches):
        at = f"(line {line_no})"
        if isinstance(value, json.JSONDecodeError):
            bad.append(BadRow(path, row, None, f"invalid JSON {at}: {value.msg} at column "
                                               f"{value.colno} (a truncated file?)"))
        elif not isinstance(value, dict):
            bad.append(BadRow(path, row, None, f"a row must be a JSON object {at}, got "
                                               f"{type(value).__name__}"))
        elif mismatch is not None:
            bad.append(BadRow(path, row, mismatch[0],
                              mismatch_problem(mismatch, prompt_key, f" {at}")))
        else:
            rows.append(value)
            row_numbers.append(row)
    return rows, row_numbers, bad
