"""The data-stage report the trainer logs before building models: files, rows, what was left out
or cut and why, prompts per step, steps per epoch."""
import logging

from tests.data.files import gsm8k_rows, write_rows
from tests.data.tiny_tokenizer import make_tiny_tokenizer
from verl_mcore.config.schema import DataConfig
from verl_mcore.data import RLHFDataset
from verl_mcore.data.report import log_data_stage


def _rows(n_long):
    rows = gsm8k_rows(11)
    for i in range(n_long):
        rows[i]["prompt"] = [{"role": "user", "content": "hello " * 30}]  # over 20 tokens
    return rows


def test_filtered_and_bad_rows_are_counted_with_their_reason(tmp_path, caplog):
    tok = make_tiny_tokenizer()
    rows = _rows(2)
    rows[5]["prompt"] = None  # a bad row, skipped
    train_file = write_rows(str(tmp_path / "train.parquet"), rows, "parquet")
    val_file = write_rows(str(tmp_path / "val.jsonl"), gsm8k_rows(3), "jsonl")
    data = DataConfig(max_prompt_length=20, truncation="filter", on_bad_row="skip",
                      train_batch_size=4)
    train, val = RLHFDataset(train_file, tok, data), RLHFDataset(val_file, tok, data)
    with caplog.at_level(logging.INFO, logger="verl_mcore.data"):
        log_data_stage(train, val, data, steps_per_epoch=len(train) // 4)
    lines = [r.getMessage() for r in caplog.records if r.name == "verl_mcore.data"]
    assert lines == [
        f"data train: 1 file ({train_file}): 11 rows read -> 8 prompts (1 bad rows skipped "
        "(data.on_bad_row=skip); 2 longer than data.max_prompt_length=20 left out "
        "(data.truncation=filter)); 4 prompts per step, 2 steps per epoch",
        f"data val: 1 file ({val_file}): 3 rows read -> 3 prompts (none dropped or truncated); "
        "validated in batches of 3",
    ]


def test_truncated_prompts_and_an_unused_tail(tmp_path, caplog):
    tok = make_tiny_tokenizer()
    files = [write_rows(str(tmp_path / f"part{i}.parquet"), _rows(1), "parquet") for i in range(4)]
    data = DataConfig(max_prompt_length=20, truncation="truncate_left", train_batch_size=8)
    train = RLHFDataset(files, tok, data)
    with caplog.at_level(logging.INFO, logger="verl_mcore.data"):
        log_data_stage(train, None, data, steps_per_epoch=len(train) // 8)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "verl_mcore.data"]
    assert line.startswith(f"data train: 4 files ({files[0]}, {files[1]}, {files[2]}, +1 more): "
                           "44 rows read -> 44 prompts (4 cut to data.max_prompt_length=20 "
                           "(data.truncation=truncate_left)); 8 prompts per step, 5 steps per "
                           "epoch (4 prompts of each epoch unused: a batch is always full)"), line
