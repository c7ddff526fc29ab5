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

A custom dataset subclasses RLHFDataset and overrides one of two hooks; it is named by
`data.custom_cls.path` / `data.custom_cls.name` and built by `build_dataset`:
  read_file(path)               one file -> rows (errors then name that file and its rows);
  _read_files_and_tokenize()    verl's hook: read all of `self.data_files` and set
                                `self.dataframe` (a pyarrow Table, a `datasets.Dataset`, a pandas
                                DataFrame or a list of row dicts), optionally through
                                `self.maybe_filter_out_long_prompts(frame)`.
Either way the rows are then checked, rendered, tokenised, length-limited and batched exactly as
the default reader's. A subclass overriding neither, or overriding a verl method this class never
calls (`__getitem__`, `_build_messages`, ...), is warned about when it is loaded.
"""
from __future__ import annotations

import itertools
import logging
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import pyarrow as pa

from verl_mcore.config.schema import DataConfig
from verl_mcore.data.chat import ToolPrompt
from verl_mcore.data.checks import check_columns, check_same_schema, prompt_problem
from verl_mcore.data.errors import BadRow, DataError
from verl_mcore.data.loader import PromptBatch
from verl_mcore.data.readers import (DEFAULT_EXTENSIONS, FileRows, kind_mismatches,
                                     mismatch_problem, plain_types, read_file_rows,
                                     resolve_files)
from verl_mcore.user_code import (ExitCalled, check_import, exit_raises_in_this_thread,
                                  load_user_object)

logger = logging.getLogger(__name__)

try:
    from jinja2 import TemplateError as _TemplateError
    _TEMPLATE_ERRORS: tuple[type, ...] = (_TemplateError,)
except ImportError:  # transformers needs jinja2 only to render chat templates
    _TEMPLATE_ERRORS = ()

_CHUNK_ROWS = 2048  # rows rendered and tokenised together (the fast tokenizer batches in Rust)
_REPORTED_BAD_ROWS = 5

# The hooks this class calls, for the warning about a subclass that overrides none of them.
_HOOKS = ("read_file", "_read_files_and_tokenize")
# Methods verl users override on verl's RLHFDataset that nothing here calls: batches come from
# `get_batch` over the token ids tokenised up front, so an override of these would be ignored.
_VERL_METHODS_NOT_CALLED = ("__getitem__", "_build_messages", "_download", "resume_dataset_state")
_warned_classes: set[type] = set()


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

    def __init__(self, files: Union[str, Sequence[str]], tokenizer: Any, config: DataConfig,
                 processor: Any = None, max_samples: int = -1, *, rows: Any = None):
        """rows: the prompt rows themselves (a pyarrow Table or a list of row dicts, as a
        `dataframe`) instead of reading `files`, which is then one string naming them in
        messages (the Python API's RolloutWorker.generate: verl_mcore/api).

        `processor` and `max_samples` are verl's RLHFDataset arguments, so a verl subclass's
        `super().__init__(data_files, tokenizer, config, processor, max_samples)` runs:
        processor must be None (text prompts only; verl's is a multimodal processor);
        max_samples > 0 keeps that many of the rows read, as verl does: the first ones, or
        with data.shuffle a random choice by data.seed (numpy's default_rng(seed).choice, the
        same rows as verl, kept here in file order; the trainer's config has data.seed resolved,
        config/seeds.py)."""
        if processor is not None:
            raise DataError(str(files), f"{type(self).__name__} was given processor="
                                        f"{type(processor).__name__}: multimodal processors are "
                                        "not supported (text prompts only); pass None")
        self.processor = processor
        self.max_samples = max_samples
        self.config = config
        self.tokenizer = tokenizer
        self.prompt_key = config.prompt_key
        self.files = [files] if rows is not None else resolve_files(files, self.extensions)
        self.data_files = self.files  # verl's name, which _read_files_and_tokenize overrides use
        self.max_prompt_length = config.max_prompt_length
        self.stats = DatasetStats()
        self.bad_rows: list[BadRow] = []  # the first few skipped rows, for the report
        self._use_template = bool(config.apply_chat_template
                                  and getattr(tokenizer, "chat_template", None))
        self._tool_prompt: Optional[ToolPrompt] = None  # data.tools, on the first prompt
        self._parts: Optional[list[FileRows]] = None
        self._files_table: Optional[pa.Table] = None  # the default `dataframe`, built on access
        self._dataframe: Any = None  # what an override set as self.dataframe
        self._too_long_tokens: Optional[tuple[int, int]] = None  # (shortest, longest) filtered
        self._filtered_by_override = False  # maybe_filter_out_long_prompts left some out
        if rows is None:
            self._read_files_and_tokenize()
        else:
            self.dataframe = rows
        self._take_dataframe()
        self._keep_max_samples()
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
            raise DataError(", ".join(self.files), self._nothing_left())

    # ---- the override point ------------------------------------------------------------------

    def read_file(self, path: str) -> Union[pa.Table, list[dict], FileRows]:
        """Read one file into rows: a pyarrow Table or a list of row dicts (one key per column).

        Override this in a custom dataset to read another format or reshape rows; checking,
        rendering, tokenising, filtering and batching are inherited. Raise DataError (naming the
        file) for a file that cannot be read.
        """
        return read_file_rows(path, self.config.on_bad_row, self.prompt_key)

    def _read_files_and_tokenize(self) -> None:
        """Read `self.data_files` (verl's hook, under verl's name; tokenising follows it).

        This one reads each file through `read_file`, keeping each row's file and row number for
        messages. An override sets `self.dataframe` to all the rows: a pyarrow Table, a
        `datasets.Dataset`, a pandas DataFrame or a list of row dicts; messages then name rows
        of that frame. It may call `super()._read_files_and_tokenize()` first and reshape
        `self.dataframe` (a pyarrow Table of every file's rows).
        """
        self._parts = [self._load(path) for path in self.files]
        check_same_schema([(p.path, p.table) for p in self._parts])

    @property
    def dataframe(self) -> Any:
        """The rows: what `_read_files_and_tokenize` set, else a pyarrow Table of every file's rows."""
        if self._dataframe is not None:
            return self._dataframe
        if self._parts is None:
            raise AttributeError(f"{type(self).__name__}.dataframe is not read yet: call "
                                 f"super()._read_files_and_tokenize() first, or set it")
        if self._files_table is None:
            try:
                self._files_table = pa.concat_tables([p.table for p in self._parts],
                                                     promote_options="permissive")
            except pa.ArrowException as e:
                raise DataError(", ".join(self.files), f"the files' tables do not concatenate "
                                                       f"into one dataframe: {e}") from e
        return self._files_table

    @dataframe.setter
    def dataframe(self, value: Any) -> None:
        self._dataframe = value

    def maybe_filter_out_long_prompts(self, dataframe: Any) -> Any:
        """`dataframe` without the prompts longer than data.max_prompt_length tokens after the
        chat template, when data.truncation=filter (verl's filter_overlong_prompts); unchanged
        otherwise, where the data.truncation policy applies when tokenising. Returns the type it
        got (pyarrow Table, datasets.Dataset, pandas DataFrame, list of dicts).

        Rows with a bad prompt raise, naming their row of `dataframe`, or are left out under
        data.on_bad_row=skip (here, so that the row named is the one of `dataframe`). Rows left
        out are counted in `stats` as when tokenising.
        """
        if self.config.truncation != "filter":
            return dataframe
        part = self._frame_part(dataframe, "maybe_filter_out_long_prompts got")
        keep = np.zeros(part.table.num_rows, dtype=bool)
        for rows, encoded in self._encoded_chunks(part):
            for row, ids in zip(rows, encoded):
                keep[row] = len(ids) <= self.config.max_prompt_length
                if not keep[row]:
                    self._left_out_too_long(len(ids))
                    self._filtered_by_override = True
        return _select_rows(dataframe, keep)

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
        part = got if isinstance(got, FileRows) else FileRows(
            path, _as_table(got, path, f"{type(self).__name__}.read_file returned",
                            self.prompt_key))
        part.table = plain_types(path, part.table)
        for bad in part.bad_rows:
            self._note_bad_row(bad)
        if part.table.num_rows == 0 and part.bad_rows:
            raise DataError(path, f"data.on_bad_row=skip skipped every row of the file as bad "
                                  f"({len(part.bad_rows)} rows), e.g. {part.bad_rows[0]}")
        if part.table.num_rows == 0 and type(self).read_file is not RLHFDataset.read_file:
            raise DataError(path, f"{type(self).__name__}.read_file ({_source_file(type(self))}) "
                                  f"returned no rows for this file; check its own reading and "
                                  f"filtering")
        check_columns(path, part.table, self.prompt_key, part.file_row)
        return part

    def _frame_label(self) -> str:
        """Where a row of a dataframe set by an override is, for messages."""
        files = self.files[0] + (f" and {len(self.files) - 1} more" if len(self.files) > 1 else "")
        return f"{type(self).__name__}.dataframe (read from {files})"

    def _take_dataframe(self) -> None:
        """After `_read_files_and_tokenize`: a dataframe it set becomes the one part to tokenise."""
        if self._dataframe is None or self._dataframe is self._files_table:
            if self._parts is None:
                raise DataError(", ".join(self.files), f"{type(self).__name__}."
                                f"_read_files_and_tokenize set no self.dataframe; set it to the "
                                f"rows (a pyarrow Table, datasets.Dataset, pandas DataFrame or "
                                f"list of dicts)")
            return
        self._parts = [self._frame_part(self._dataframe, f"{type(self).__name__}.dataframe is")]

    def _keep_max_samples(self) -> None:
        """verl's max_samples: of the rows read, keep that many (see __init__)."""
        total = sum(part.table.num_rows for part in self._parts)
        if not 0 < self.max_samples < total:
            return
        if self.config.shuffle:
            if self.config.seed is None:
                # default_rng(None) draws from the OS: other rows at every start, on every rank.
                raise ValueError(f"{type(self).__name__}: max_samples={self.max_samples} with "
                                 "data.shuffle draws its rows by data.seed, which is null here; "
                                 "give the dataset a DataConfig with a seed (the trainer passes "
                                 "the one it derives from trainer.seed, config/seeds.py)")
            chosen = np.random.default_rng(self.config.seed).choice(total, self.max_samples,
                                                                    replace=False)
        else:
            chosen = np.arange(self.max_samples)
        chosen, start, kept = np.sort(chosen), 0, []
        for part in self._parts:
            n = part.table.num_rows
            local = chosen[(chosen >= start) & (chosen < start + n)] - start
            start += n
            if len(local):
                numbers = np.asarray([part.file_row(i) for i in local], dtype=np.int64)
                kept.append(FileRows(part.path, part.table.take(pa.array(local)), numbers,
                                     part.bad_rows))
        self._parts = kept

    def _frame_part(self, frame: Any, what: str) -> FileRows:
        """A dataframe from an override as the part to check and tokenise; `what` is for errors."""
        label = self._frame_label()
        table = plain_types(label, _as_table(frame, label, what, self.prompt_key))
        if table.num_rows == 0:
            raise DataError(label, self._nothing_left() if self.stats.too_long_filtered
                            or self.stats.bad_rows_skipped else
                            f"the dataframe has no rows: {type(self).__name__}"
                            f"._read_files_and_tokenize ({_source_file(type(self))}) kept none "
                            f"of the rows of {len(self.files)} file(s); check its own reading "
                            f"and filtering")
        check_columns(label, table, self.prompt_key)
        return FileRows(label, table)

    def _left_out_too_long(self, n_tokens: int) -> None:
        """Count a prompt of `n_tokens` left out by data.truncation=filter."""
        self.stats.too_long_filtered += 1
        low, high = self._too_long_tokens or (n_tokens, n_tokens)
        self._too_long_tokens = (min(low, n_tokens), max(high, n_tokens))

    def _nothing_left(self) -> str:
        """Why no prompt is left: which setting left out how many rows, and what to change."""
        s, cfg = self.stats, self.config
        seen = s.too_long_filtered + s.bad_rows_skipped  # nothing was kept
        out, fixes = [], []
        if s.too_long_filtered:
            low, high = self._too_long_tokens
            by = "maybe_filter_out_long_prompts with " if self._filtered_by_override else ""
            span = f"{low}" if low == high else f"{low} to {high}"
            out.append(f"{by}data.max_prompt_length={cfg.max_prompt_length} "
                       f"(data.truncation=filter) left out {s.too_long_filtered} of the {seen} "
                       f"rows: their prompts have {span} tokens after the chat template")
            every = "" if low == high else f" ({high} keeps every prompt)"
            tools = self._shows_tools()
            fixes.append(f"raise data.max_prompt_length to at least {low}{every}" + (
                " (the prompts include the tools' description, data.tools)" if tools else
                ", or set data.truncation=truncate_left to keep them shortened"))
        if s.bad_rows_skipped:
            out.append(f"data.on_bad_row=skip skipped {s.bad_rows_skipped} of the {seen} rows as "
                       f"bad, e.g. {self.bad_rows[0]}")
            fixes.append("repair the bad rows (the warning above lists the first ones)")
        if not out:
            return "no prompt is left"
        return f"no prompt is left: {'; '.join(out)}. To keep some, {'; or '.join(fixes)}"

    def _note_bad_row(self, bad: BadRow) -> None:
        self.stats.bad_rows_skipped += 1
        if len(self.bad_rows) < _REPORTED_BAD_ROWS:
            self.bad_rows.append(bad)

    def _render(self, prompt: Any) -> str:
        if self._use_template:
            messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
                        [{k: v for k, v in m.items() if v is not None} for m in prompt])
            # data.tools: the tools the model may call, shown the template's way (data/chat.py)
            if getattr(self, "_tool_prompt", None) is None:
                self._tool_prompt = ToolPrompt(self.tokenizer,
                                               getattr(self.config, "tools", None) or ())
            messages, extra = self._tool_prompt.messages(messages)
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False, **extra)
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

    def _encoded_chunks(self, part: FileRows) -> Iterator[tuple[list[int], list[list[int]]]]:
        """(table rows, their token ids) chunk by chunk, for the usable prompts of `part`; a bad
        prompt raises, or is noted and left out under data.on_bad_row=skip."""
        prompts = part.table.column(self.prompt_key)
        for start in range(0, part.table.num_rows, _CHUNK_ROWS):
            texts, rows = [], []
            for offset, prompt in enumerate(prompts.slice(start, _CHUNK_ROWS).to_pylist()):
                row = start + offset
                problem = prompt_problem(prompt)
                if problem is None:
                    try:
                        texts.append(self._render(prompt))
                        rows.append(row)
                        continue
                    except _TEMPLATE_ERRORS as e:  # e.g. a template that wants roles to alternate
                        problem = (f"the tokenizer's chat template fails on this prompt "
                                   f"({type(e).__name__}): {e}")
                bad = BadRow(part.path, part.file_row(row), self.prompt_key, problem)
                if self.config.on_bad_row != "skip":
                    raise DataError(bad.path, problem, bad.row, bad.column)
                self._note_bad_row(bad)
            if texts:
                yield rows, self._encode(texts)

    def _tokenise_all(self) -> None:
        limit = self.config.max_prompt_length
        id_chunks, lengths, part_of, row_of = [], [], [], []
        for part_index, part in enumerate(self._parts):
            for rows, encoded in self._encoded_chunks(part):
                kept, kept_rows = [], []
                for row, ids in zip(rows, encoded):
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
        # Every row read is kept, skipped as bad or filtered as too long — also the rows that
        # maybe_filter_out_long_prompts left out before they reached a part.
        self.stats.rows_read = len(lengths) + self.stats.bad_rows_skipped + self.stats.too_long_filtered

    def _shows_tools(self) -> bool:
        """Whether the prompts show data.tools (ToolPrompt, made at the first prompt)."""
        shown = getattr(self, "_tool_prompt", None)
        return shown is not None and bool(shown.schemas)

    def _too_long(self, ids: list[int], part: FileRows, row: int) -> Optional[list[int]]:
        """Apply data.truncation to a prompt longer than data.max_prompt_length."""
        cfg = self.config
        limit = cfg.max_prompt_length
        if cfg.truncation == "filter":
            self._left_out_too_long(len(ids))
            return None
        # data.tools: the tools' description opens the prompt (the system turn), so a cut on
        # the left would take the tools away from the model without a word.
        tools = self._shows_tools()
        if cfg.truncation == "truncate_left" and tools:
            raise DataError(part.path, f"the prompt has {len(ids)} tokens (after the chat "
                                       f"template), more than data.max_prompt_length={limit}, and "
                                       "data.truncation=truncate_left would cut the tools' "
                                       "description (data.tools, at the prompt's start) off it: "
                                       "raise data.max_prompt_length, or set data.truncation="
                                       "filter", part.file_row(row), self.prompt_key)
        if cfg.truncation == "truncate_left":  # keep the end: the generation prompt is there
            self.stats.too_long_truncated += 1
            return ids[len(ids) - limit:]
        if cfg.truncation == "truncate_right":
            self.stats.too_long_truncated += 1
            return ids[:limit]
        shown = (" including the tools' description (data.tools, which a left cut would drop)"
                 if tools else "")
        raise DataError(part.path, f"the prompt has {len(ids)} tokens (after the chat template"
                                   f"{shown}), more than data.max_prompt_length={limit}; raise it, "
                                   f"or set data.truncation to filter"
                                   + ("" if tools else ", truncate_left or truncate_right"),
                        part.file_row(row), self.prompt_key)


def _loaded(module: str, name: str) -> Optional[type]:
    """`module.name` if the user's code imported `module`, else None. A frame of that library's
    type can only exist once it is imported, so checking sys.modules keeps pandas and `datasets`
    optional and never imports them here."""
    return getattr(sys.modules.get(module), name, None)


def _as_table(frame: Any, where: str, what: str, prompt_key: Optional[str] = None) -> pa.Table:
    """A pyarrow Table of `frame`'s rows; `where` and `what` ("X.dataframe is") go into errors,
    `prompt_key` (data.prompt_key) into the one about a column of mixed kinds."""
    kinds = "a pyarrow Table, a datasets.Dataset, a pandas DataFrame or a list of row dicts"
    if isinstance(frame, pa.Table):
        return frame
    if isinstance(frame, list):  # an empty one is an empty table, said by the callers
        for row, item in enumerate(frame):
            if not isinstance(item, dict):
                raise DataError(where, f"a row must be a dict (one key per column), got "
                                       f"{type(item).__name__} {str(item)[:60]!r}", row)
        try:
            return pa.Table.from_pylist(frame)
        except (pa.ArrowException, TypeError, ValueError) as e:
            _raise_mixed_kinds(frame, where, prompt_key, e)
            raise DataError(where, f"the rows do not form one table (a column with mixed "
                                   f"types?): {e}") from e
    dataset, dataset_dict = _loaded("datasets", "Dataset"), _loaded("datasets", "DatasetDict")
    if dataset is not None and isinstance(frame, dataset):
        # The arrow format gives the rows as one Table, zero-copy when no select/filter
        # left an indices mapping; the frame's own format setting is not changed.
        return frame.with_format("arrow")[:]
    if dataset_dict is not None and isinstance(frame, dataset_dict):
        raise DataError(where, f"{what} a datasets.DatasetDict (splits {sorted(frame)}); use one "
                               f"split, e.g. frame['train']")
    pandas_frame = _loaded("pandas", "DataFrame")
    if pandas_frame is not None and isinstance(frame, pandas_frame):
        try:
            return pa.Table.from_pandas(frame, preserve_index=False)
        except (pa.ArrowException, TypeError, ValueError) as e:
            _raise_mixed_kinds(frame.to_dict("records"), where, prompt_key, e)
            raise DataError(where, f"the pandas DataFrame does not convert to Arrow (a column "
                                   f"with mixed types?): {e}") from e
    raise DataError(where, f"{what} {type(frame).__module__}.{type(frame).__name__}; it must be "
                           f"{kinds}")


def _raise_mixed_kinds(rows: list[dict], where: str, prompt_key: Optional[str],
                       arrow_error: Exception) -> None:
    """Raise a DataError naming the first row whose value has another kind than the other rows'
    in that column (what made Arrow refuse `rows`), when there is one."""
    found = [(row, m) for row, m in enumerate(kind_mismatches(rows)) if m is not None]
    if found:
        row, mismatch = found[0]
        raise DataError(where, mismatch_problem(mismatch, prompt_key), row,
                        mismatch[0]) from arrow_error


def _source_file(cls: type) -> str:
    """The file that defines `cls`, for messages."""
    return getattr(sys.modules.get(cls.__module__), "__file__", None) or cls.__module__


def _select_rows(frame: Any, keep: np.ndarray) -> Any:
    """The rows of `frame` where `keep` [rows] bool is set, as the same type as `frame`."""
    if isinstance(frame, pa.Table):
        return frame.filter(pa.array(keep))
    if isinstance(frame, list):
        return [row for row, kept in zip(frame, keep.tolist()) if kept]
    dataset = _loaded("datasets", "Dataset")
    if dataset is not None and isinstance(frame, dataset):
        return frame.select(np.flatnonzero(keep))
    # A pandas DataFrame (_as_table accepted nothing else): renumbered as datasets' filter does.
    return frame[keep].reset_index(drop=True)


def _warn_about_hooks(cls: type, where: str) -> None:
    """Warn (once per class) when `cls` overrides no hook this class calls, or overrides a verl
    method nothing here calls: its rows would silently be the default reader's."""
    if cls in _warned_classes:
        return
    own = set().union(*(vars(k) for k in cls.__mro__[:cls.__mro__.index(RLHFDataset)]))
    ignored = [name for name in _VERL_METHODS_NOT_CALLED if name in own]
    if ignored or not own.intersection(_HOOKS):
        _warned_classes.add(cls)
        why = (f"it defines {', '.join(ignored)}, which verl_mcore never calls" if ignored else
               f"it overrides neither {' nor '.join(_HOOKS)}")
        logger.warning("%s: %s is read exactly as RLHFDataset reads files: %s. The methods "
                       "called are read_file(path) -> rows of one file, or "
                       "_read_files_and_tokenize() setting self.dataframe (optionally through "
                       "self.maybe_filter_out_long_prompts(frame)); batches are always built "
                       "from those rows.", where, cls.__name__, why)


def load_dataset_class(config: DataConfig) -> type:
    """RLHFDataset, or the subclass named by data.custom_cls.path / data.custom_cls.name."""
    custom = config.custom_cls
    if not custom.path and not custom.name:
        return RLHFDataset
    check_import(custom.path, custom.name, "data.custom_cls", config.import_timeout_s,
                 "data.import_timeout_s")  # blocking or exiting at import fails here, named
    # The probe above imported the file in a process of its own; this import runs in the
    # trainer, where an exit would end the run with no word (a file that exits only here).
    rule = (f"data.custom_cls ({custom.path}, importing it in the trainer)",
            "the trainer would have ended without a word: a dataset file must not exit at import")
    try:
        with exit_raises_in_this_thread(rule):
            cls = load_user_object(custom.path, custom.name, "data.custom_cls")
    except ExitCalled as e:  # (sys.exit is a SystemExit, which load_user_object names)
        raise ValueError(str(e)) from None
    if not (isinstance(cls, type) and issubclass(cls, RLHFDataset)):
        raise ValueError(f"data.custom_cls: {custom.name} in {custom.path} must be a subclass of "
                         f"verl_mcore.data.RLHFDataset (override read_file or "
                         f"_read_files_and_tokenize), got {cls!r}")
    _warn_about_hooks(cls, f"data.custom_cls ({custom.path})")
    return cls


def build_dataset(files: Union[str, Sequence[str]], tokenizer: Any,
                  config: DataConfig) -> RLHFDataset:
    """The dataset for `files`: the custom class when data.custom_cls is set, else RLHFDataset."""
    return load_dataset_class(config)(files, tokenizer, config)
