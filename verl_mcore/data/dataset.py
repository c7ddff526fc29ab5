"""RLHFDataset: prompt rows from Parquet / Arrow / JSON Lines files, tokenised once, up front.

    ds = RLHFDataset(cfg.data.train_files, tokenizer, cfg.data)   # reads, checks, tokenises
    ds.get_batch([3, 1, 4])  -> PromptBatch (token ids + each row's fields)

Everything that can be wrong with the files is found in the constructor, before training starts
(see `checks.py` for the row layout). Prompts are rendered with the tokenizer's chat template
(a plain-string prompt becomes one user message); without a template, or with
`data.apply_chat_template=False`, the prompt is plain text: the string itself, or the messages'
contents joined by newlines, tokenised with the tokenizer's special tokens (e.g. BOS).

Memory: the token ids of all prompts live in one flat int32 array; the other columns stay in
the (memory-mapped where the format allows) Arrow tables and become Python objects only for the
rows of a requested batch.

A custom dataset subclasses RLHFDataset and overrides `read_file` (one file -> rows); it is named
by `data.custom_cls.path` / `data.custom_cls.name` and built by `build_dataset`.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import pyarrow as pa

from verl_mcore.config.schema import DataConfig
from verl_mcore.data.checks import check_columns, check_same_schema, prompt_problem
from verl_mcore.data.errors import BadRow, DataError
from verl_mcore.data.loader import PromptBatch
from verl_mcore.data.readers import DEFAULT_EXTENSIONS, FileRows, read_file_rows, resolve_files
from verl_mcore.user_code import check_import, load_user_object

logger = logging.getLogger(__name__)

_CHUNK_ROWS = 2048  # rows rendered and tokenised together (the fast tokenizer batches in Rust)
_REPORTED_BAD_ROWS = 5


@dataclass
class DatasetStats:
    rows_read: int = 0
    bad_rows_skipped: int = 0  # data.on_bad_row=skip
    too_long_filtered: int = 0  # data.truncation=filter
    too_long_truncated: int = 0  # data.truncation=truncate_left / truncate_right

    def as_metrics(self, prefix: str = "data/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in vars(self).items()}


class RLHFDataset:
    """Prompts of one split (train or validation), checked and tokenised.

    Sample i is the i-th kept row, in file order then row order. `len(ds)` counts kept rows.
    """

    #: File endings picked from a directory; a subclass reading other formats changes this.
    extensions: tuple[str, ...] = DEFAULT_EXTENSIONS

    def __init__(self, files: Union[str, Sequence[str]], tokenizer: Any, config: DataConfig):
        self.config = config
        self.tokenizer = tokenizer
        self.prompt_key = config.prompt_key
        self.files = resolve_files(files, self.extensions)
        self.stats = DatasetStats()
        self.bad_rows: list[BadRow] = []  # the first few skipped rows, for the report
        self._parts = [self._load(path) for path in self.files]
        check_same_schema([(p.path, p.table) for p in self._parts])
        self._use_template = bool(config.apply_chat_template
                                  and getattr(tokenizer, "chat_template", None))
        self._tokenise_all()
        if self.bad_rows:
            shown = "\n  ".join(str(b) for b in self.bad_rows)
            logger.warning("data: skipped %d bad rows (data.on_bad_row=skip); the first ones:\n  %s",
                           self.stats.bad_rows_skipped, shown)
        if self.stats.too_long_filtered:
            logger.warning("data: left out %d prompts longer than data.max_prompt_length=%d "
                           "(data.truncation=filter)", self.stats.too_long_filtered,
                           config.max_prompt_length)
        if len(self) == 0:
            raise DataError(", ".join(self.files), "no usable prompt is left (all rows were bad "
                                                   "or too long); see the warnings above")

    # ---- the override point ------------------------------------------------------------------

    def read_file(self, path: str) -> Union[pa.Table, list[dict], FileRows]:
        """Read one file into rows: a pyarrow Table or a list of row dicts (one key per column).

        Override this in a custom dataset to read another format or reshape rows; checking,
        rendering, tokenising, filtering and batching are inherited. Raise DataError (naming the
        file) for a file that cannot be read.
        """
        return read_file_rows(path, self.config.on_bad_row)

    # ---- public access -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def prompt_ids(self, i: int) -> list[int]:
        return self._ids[self._offsets[i]:self._offsets[i + 1]].tolist()

    def rows(self, indices: Sequence[int]) -> list[dict]:
        """The full rows (every column as a Python object) of samples `indices`, in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        out: list[Optional[dict]] = [None] * len(indices)
        parts = self._part_of[indices]
        for part in np.unique(parts):
            where = np.flatnonzero(parts == part)
            taken = self._parts[part].table.take(pa.array(self._row_of[indices[where]]))
            for slot, row in zip(where.tolist(), taken.to_pylist()):
                out[slot] = row
        return out

    def get_batch(self, indices: Sequence[int]) -> PromptBatch:
        indices = [int(i) for i in indices]
        return PromptBatch(indices=indices, input_ids=[self.prompt_ids(i) for i in indices],
                           rows=self.rows(indices))

    def __getitem__(self, i: int) -> dict:
        """{"input_ids": list[int], "row": dict} for sample i."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of a dataset of {len(self)}")
        i %= len(self)
        return {"input_ids": self.prompt_ids(i), "row": self.rows([i])[0]}

    def distinct(self, columns: Sequence[str]) -> set[tuple]:
        """The distinct value combinations of `columns` over the kept samples (a missing column
        reads as None) — e.g. to check before training that every data_source has a scorer."""
        combos: set[tuple] = set()
        for part_index, part in enumerate(self._parts):
            rows = self._row_of[self._part_of == part_index]
            present = [c for c in columns if c in part.table.column_names]
            if not len(rows):
                continue
            if not present:
                combos.add((None,) * len(columns))
                continue
            kept = part.table.select(present).take(pa.array(rows))
            for values in kept.group_by(present).aggregate([]).to_pylist():
                combos.add(tuple(values.get(c) for c in columns))
        return combos

    def source_of(self, i: int) -> tuple[str, int]:
        """(file, row in that file) of sample i — for messages that point at the data."""
        part = self._parts[self._part_of[i]]
        return part.path, part.file_row(int(self._row_of[i]))

    # ---- construction --------------------------------------------------------------------------

    def _load(self, path: str) -> FileRows:
        got = self.read_file(path)
        if isinstance(got, FileRows):
            part = got
        elif isinstance(got, pa.Table):
            part = FileRows(path, got)
        elif isinstance(got, list):
            if not got:
                raise DataError(path, "the file has no rows")
            try:
                part = FileRows(path, pa.Table.from_pylist(got))
            except (pa.ArrowException, TypeError, ValueError) as e:
                raise DataError(path, f"the rows read by {type(self).__name__}.read_file do not "
                                      f"form one table (a column with mixed types?): {e}") from e
        else:
            raise TypeError(f"{type(self).__name__}.read_file({path!r}) returned "
                            f"{type(got).__name__}; return a pyarrow.Table or a list of dicts")
        for bad in part.bad_rows:
            self._note_bad_row(bad)
        check_columns(path, part.table, self.prompt_key, part.file_row)
        return part

    def _note_bad_row(self, bad: BadRow) -> None:
        self.stats.bad_rows_skipped += 1
        if len(self.bad_rows) < _REPORTED_BAD_ROWS:
            self.bad_rows.append(bad)

    def _render(self, prompt: Any) -> str:
        if self._use_template:
            messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
                        [{k: v for k, v in m.items() if v is not None} for m in prompt])
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # The chat template already holds BOS and friends; plain text gets them here.
        special = not self._use_template
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            # The Rust tokenizer directly: same ids as tokenizer(texts), without building
            # attention masks and offsets nobody uses (a third of the time on 100k prompts).
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=special)]
        return self.tokenizer(texts, add_special_tokens=special)["input_ids"]

    def _tokenise_all(self) -> None:
        cfg = self.config
        limit = cfg.max_prompt_length
        id_chunks, lengths, part_of, row_of = [], [], [], []
        for part_index, part in enumerate(self._parts):
            self.stats.rows_read += part.table.num_rows + len(part.bad_rows)
            prompts = part.table.column(self.prompt_key)
            for start in range(0, part.table.num_rows, _CHUNK_ROWS):
                values = prompts.slice(start, _CHUNK_ROWS).to_pylist()
                texts, rows = [], []
                for offset, prompt in enumerate(values):
                    row = start + offset
                    problem = prompt_problem(prompt)
                    if problem is not None:
                        bad = BadRow(part.path, part.file_row(row), self.prompt_key, problem)
                        if cfg.on_bad_row != "skip":
                            raise DataError(bad.path, problem, bad.row, bad.column)
                        self._note_bad_row(bad)
                        continue
                    texts.append(self._render(prompt))
                    rows.append(row)
                if not texts:
                    continue
                kept, kept_rows = [], []
                for row, ids in zip(rows, self._encode(texts)):
                    if len(ids) > limit:
                        ids = self._too_long(ids, part, row)
                        if ids is None:
                            continue
                    kept.append(ids)
                    kept_rows.append(row)
                sizes = [len(ids) for ids in kept]
                id_chunks.append(np.fromiter(itertools.chain.from_iterable(kept), dtype=np.int32,
                                             count=sum(sizes)))
                lengths.extend(sizes)
                part_of.extend([part_index] * len(kept_rows))
                row_of.extend(kept_rows)
        self._ids = np.concatenate(id_chunks) if id_chunks else np.zeros(0, np.int32)
        self._offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self._offsets[1:])
        self._part_of = np.asarray(part_of, dtype=np.int32)
        self._row_of = np.asarray(row_of, dtype=np.int64)

    def _too_long(self, ids: list[int], part: FileRows, row: int) -> Optional[list[int]]:
        """Apply data.truncation to a prompt longer than data.max_prompt_length."""
        cfg = self.config
        limit = cfg.max_prompt_length
        if cfg.truncation == "filter":
            self.stats.too_long_filtered += 1
            return None
        if cfg.truncation == "truncate_left":  # keep the end: the generation prompt is there
            self.stats.too_long_truncated += 1
            return ids[len(ids) - limit:]
        if cfg.truncation == "truncate_right":
            self.stats.too_long_truncated += 1
            return ids[:limit]
        raise DataError(part.path, f"the prompt has {len(ids)} tokens (after the chat template), "
                                   f"more than data.max_prompt_length={limit}; raise it, or set "
                                   f"data.truncation to filter, truncate_left or truncate_right",
                        part.file_row(row), self.prompt_key)


def load_dataset_class(config: DataConfig) -> type:
    """RLHFDataset, or the subclass named by data.custom_cls.path / data.custom_cls.name."""
    custom = config.custom_cls
    if not custom.path and not custom.name:
        return RLHFDataset
    check_import(custom.path, custom.name, "data.custom_cls", config.import_timeout_s,
                 "data.import_timeout_s")  # blocking or exiting at import fails here, named
    cls = load_user_object(custom.path, custom.name, "data.custom_cls")
    if not (isinstance(cls, type) and issubclass(cls, RLHFDataset)):
        raise ValueError(f"data.custom_cls: {custom.name} in {custom.path} must be a subclass of "
                         f"verl_mcore.data.RLHFDataset (override read_file), got {cls!r}")
    return cls


def build_dataset(files: Union[str, Sequence[str]], tokenizer: Any,
                  config: DataConfig) -> RLHFDataset:
    """The dataset for `files`: the custom class when data.custom_cls is set, else RLHFDataset."""
    return load_dataset_class(config)(files, tokenizer, config)
