"""What a prompt row must look like, checked before any training starts.

Row layout (the one RLHF users already have; only the prompt column is required):
  prompt        a string, or a list of {"role": str, "content": str} messages (key: data.prompt_key)
  data_source   string: picks the built-in reward scorer
  ability       string
  reward_model  {"style": ..., "ground_truth": ...}
  extra_info    a struct, passed to the reward function
  anything else (e.g. `category`) travels with the sample to the reward functions.

Column-level problems (a missing prompt column, a column of the wrong type, files whose schemas
differ) always raise: they concern every row. Row-level problems (one prompt of the wrong shape)
raise too, or are skipped and counted under `data.on_bad_row=skip`.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import pyarrow as pa

from verl_mcore.config.schema import DataConfig
from verl_mcore.data.errors import DataError
from verl_mcore.data.readers import (detect_format, nested_types, plain_types, read_file_rows,
                                     resolve_files)

# Rows of each file the preflight reads (check_files): enough to meet a wrong column or prompt
# layout, few enough that a large file costs nothing; the dataset reads every row later.
SAMPLE_ROWS = 64

# Known optional columns -> the type categories they may have ("null": a column of only nulls).
_KNOWN_COLUMNS = {
    "data_source": {"string", "null"},
    "ability": {"string", "null"},
    "reward_model": {"struct", "null"},
    "extra_info": {"struct", "null"},
}


# string_view exists from pyarrow 16 on.
_is_string_view = getattr(pa.types, "is_string_view", lambda t: False)


def type_category(t: pa.DataType) -> str:
    """A coarse type name: equal categories are interchangeable (int32/int64, string/large_string,
    structs with different fields); different ones are a real schema difference."""
    if pa.types.is_dictionary(t):
        return type_category(t.value_type)
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or _is_string_view(t):
        return "string"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return f"list<{type_category(t.value_type)}>"
    if pa.types.is_struct(t):
        return "struct"
    if pa.types.is_map(t):
        return "map"
    return str(t)


def _first_valid_row(column: pa.ChunkedArray) -> int:
    valid = np.flatnonzero(column.is_valid().to_numpy(zero_copy_only=False))
    return int(valid[0]) if valid.size else 0


def check_columns(path: str, table: pa.Table, prompt_key: str, file_row=lambda i: i) -> None:
    """Column-level checks of one file's table. `file_row` maps a table row to the file row."""
    if table.num_rows == 0:
        raise DataError(path, "the file has no rows")
    if prompt_key not in table.column_names:
        raise DataError(path, f"there is no prompt column (data.prompt_key={prompt_key!r}); the "
                              f"columns are {table.column_names}", row=None, column=prompt_key)
    for name, allowed in _KNOWN_COLUMNS.items():
        if name not in table.column_names:
            continue
        column = table.column(name)
        if any(pa.types.is_map(t) for t in nested_types(column.type)):
            # A map reaches Python as a list of (key, value) pairs, not the dict the reward
            # functions read.
            raise DataError(path, f"the column holds {column.type}: a map (e.g. Spark's MapType) "
                                  f"is not supported here; write it as a struct (one field per "
                                  f"key), as pyarrow and pandas write dicts",
                            row=file_row(_first_valid_row(column)), column=name)
        category = type_category(column.type)
        if category not in allowed:
            raise DataError(path, f"expected {' or '.join(sorted(allowed - {'null'}))}, the column "
                                  f"holds {column.type}", row=file_row(_first_valid_row(column)),
                            column=name)
        if name == "reward_model" and category == "struct":
            fields = [column.type.field(i).name for i in range(column.type.num_fields)]
            if "ground_truth" not in fields:
                raise DataError(path, f"reward_model has no 'ground_truth' field (it has "
                                      f"{fields})", row=file_row(_first_valid_row(column)),
                                column=name)


def check_same_schema(parts: Sequence[tuple[str, pa.Table]]) -> None:
    """All files must have the same columns with the same type categories."""
    first_path, first = parts[0]
    expected = {f.name: type_category(f.type) for f in first.schema}
    for path, table in parts[1:]:
        got = {f.name: type_category(f.type) for f in table.schema}
        for name in sorted(set(expected) | set(got)):
            a, b = expected.get(name), got.get(name)
            if a == b or "null" in (a, b):
                continue
            if a is None or b is None:
                has, lacks = (path, first_path) if a is None else (first_path, path)
                problem = f"mixed schemas: {has} has this column, {lacks} does not"
            else:
                problem = f"mixed schemas: {b} here, {a} in {first_path}"
            raise DataError(path, problem, row=0, column=name)


def prompt_problem(prompt: Any) -> Optional[str]:
    """None if `prompt` is a usable prompt, else what is wrong with it."""
    if prompt is None:
        return "the prompt is missing (null)"
    if isinstance(prompt, str):
        return None if prompt.strip() else "the prompt is an empty string"
    if not isinstance(prompt, (list, tuple)):
        return (f"a prompt must be a string or a list of {{role, content}} messages, got "
                f"{type(prompt).__name__} {str(prompt)[:60]!r}")
    if not prompt:
        return "the prompt is an empty list of messages"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            return (f"message {i} must be a {{role, content}} mapping, got "
                    f"{type(message).__name__} {str(message)[:60]!r}")
        for key in ("role", "content"):
            if message.get(key) is None:
                return f"message {i} has no {key!r}"
            if not isinstance(message[key], str):
                return f"message {i}: {key!r} must be a string, got {type(message[key]).__name__}"
    return None


def check_files(files, data: DataConfig, read: bool = True) -> None:
    """The preflight's data check (build.build_inputs), made before the model is read: `files`
    (data.train_files or data.val_files) exist, and with `read`, each opens as its format and
    its first SAMPLE_ROWS rows pass the checks the dataset makes of every row (columns, prompt
    layout). Raises DataError naming the file, row and column. `read=False` for a
    data.custom_cls, which reads the files its own way: any file in a directory then counts."""
    if not read:
        resolve_files(files, extensions=("",))  # any file: the class picks what it reads
        return
    parts = []
    for path in resolve_files(files):
        part = read_file_rows(path, data.on_bad_row, data.prompt_key, limit=SAMPLE_ROWS)
        if part.table.num_rows == 0 and part.bad_rows:
            continue  # all bad, under data.on_bad_row=skip: the full read tells whether all are
        table = plain_types(path, part.table)
        check_columns(path, table, data.prompt_key, part.file_row)
        if data.on_bad_row != "skip":
            for i, prompt in enumerate(table.column(data.prompt_key).to_pylist()):
                problem = prompt_problem(prompt)
                if problem is not None:
                    raise DataError(path, problem, part.file_row(i), data.prompt_key)
        parts.append((path, table))
    # A JSON Lines sample's columns are those its first rows have; Parquet and Arrow carry the
    # whole file's schema.
    typed = [(path, table) for path, table in parts if detect_format(path) != "jsonl"]
    if len(typed) > 1:
        check_same_schema(typed)
