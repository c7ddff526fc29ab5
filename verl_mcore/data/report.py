"""One readable line per split about the data stage, logged by rank 0 before the models are built.

    data train: 1 file (examples/data/quickstart_train.parquet): 1000 rows read -> 1000 prompts
      (none dropped or truncated); 16 prompts per step, 62 steps per epoch (8 prompts of each
      epoch unused: a batch is always full)
    data val: 1 file (examples/data/quickstart_val.parquet): 20 rows read -> 20 prompts (none
      dropped or truncated); validated in batches of 20

The counts are the dataset's own (RLHFDataset.stats, counted while reading and tokenising), so
what is reported is what was trained on.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from verl_mcore.config.schema import DataConfig

log = logging.getLogger("verl_mcore.data")
_FILES_SHOWN = 3


def _files(paths: list[str]) -> str:
    # Relative to the current directory when under it: the way the user wrote them.
    names = [p if os.path.relpath(p).startswith("..") else os.path.relpath(p) for p in paths]
    shown = ", ".join(names[:_FILES_SHOWN])
    more = f", +{len(names) - _FILES_SHOWN} more" if len(names) > _FILES_SHOWN else ""
    return f"{len(names)} file{'s' if len(names) != 1 else ''} ({shown}{more})"


def describe(split: str, dataset, data: DataConfig, batch_size: int,
             steps_per_epoch: Optional[int] = None) -> str:
    """`split`: train or val; `batch_size`: prompts per batch, global; `steps_per_epoch`: the
    training loader's batches per epoch (None: validation, which reads every prompt)."""
    s = dataset.stats
    changes = []
    if s.bad_rows_skipped:
        changes.append(f"{s.bad_rows_skipped} bad rows skipped (data.on_bad_row=skip)")
    if s.too_long_filtered:
        changes.append(f"{s.too_long_filtered} longer than data.max_prompt_length="
                       f"{data.max_prompt_length} left out (data.truncation=filter)")
    if s.too_long_truncated:
        changes.append(f"{s.too_long_truncated} cut to data.max_prompt_length="
                       f"{data.max_prompt_length} (data.truncation={data.truncation})")
    line = (f"data {split}: {_files(dataset.files)}: {s.rows_read} rows read -> {len(dataset)} "
            f"prompts ({'; '.join(changes) or 'none dropped or truncated'}); ")
    if steps_per_epoch is None:
        return line + f"validated in batches of {min(batch_size, len(dataset))}"
    line += f"{batch_size} prompts per step, {steps_per_epoch} steps per epoch"
    unused = len(dataset) - steps_per_epoch * batch_size
    if unused:
        line += f" ({unused} prompts of each epoch unused: a batch is always full)"
    return line


def log_data_stage(train, val, data: DataConfig, steps_per_epoch: int) -> None:
    """The trainer's report: `train` / `val` datasets (val may be None), `steps_per_epoch` from
    the training PromptLoader."""
    log.info(describe("train", train, data, data.train_batch_size, steps_per_epoch))
    if val is not None:
        log.info(describe("val", val, data, data.val_batch_size or len(val)))
