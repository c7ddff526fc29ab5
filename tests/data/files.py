"""Write prompt rows in every supported format (test helper)."""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

FORMATS = {"parquet": ".parquet", "arrow_file": ".arrow", "arrow_stream": ".arrows",
           "jsonl": ".jsonl"}


def gsm8k_rows(n: int, start: int = 0, category: str = "math") -> list[dict]:
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"How many clips did Natalia sell {i} ?"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i)},
             "extra_info": {"index": i, "split": "train"},
             "category": category}
            for i in range(start, start + n)]


def write_rows(path: str, rows: list[dict], fmt: str, batch_rows: int = 3) -> str:
    """Write `rows` to `path` as `fmt` (see FORMATS); Arrow files get several record batches."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if fmt == "jsonl":
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        return path
    table = pa.Table.from_pylist(rows)
    if fmt == "parquet":
        pq.write_table(table, path, row_group_size=batch_rows)
    elif fmt in ("arrow_file", "arrow_stream"):
        new = ipc.new_file if fmt == "arrow_file" else ipc.new_stream
        with new(path, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
    else:
        raise ValueError(fmt)
    return path


# The system prompt of Eurus-2-RL-Data's rows (shortened): 30 words, so with it the quickstart's
# prompts are over the quickstart's data.max_prompt_length=16 and the default reader keeps none.
EURUS_SYSTEM = ("When tackling complex reasoning tasks , you have access to the following actions "
                ". Use them as needed to progress through your thought process . [ASSESS] "
                "[ADVANCE] [VERIFY] [SIMPLIFY] [SYNTHESIZE] [PIVOT] [OUTPUT]")


def eurus_rows(prompts_and_answers: list[tuple[str, str]], ability: str = "copy",
               data_source: str = "eurus/repeat_digit") -> list[dict]:
    """Rows laid out as PRIME-RL/Eurus-2-RL-Data's: a system + user message list per prompt."""
    return [{"data_source": data_source,
             "prompt": [{"role": "system", "content": EURUS_SYSTEM},
                        {"role": "user", "content": question}],
             "ability": ability,
             "reward_model": {"style": "rule", "ground_truth": answer},
             "extra_info": {"split": "train", "index": i}}
            for i, (question, answer) in enumerate(prompts_and_answers)]


def write_raw_arrow_export(path: str, rows: list[dict], batch_rows: int = 64) -> str:
    """`rows` as a Hugging Face `datasets` cache file is laid out (what Eurus-2-RL-Data's raw
    export is): an Arrow IPC *stream* with the features JSON in the schema metadata."""
    features = {"data_source": {"dtype": "string", "_type": "Value"}}  # enough to look the part
    table = pa.Table.from_pylist(rows).replace_schema_metadata(
        {"huggingface": json.dumps({"info": {"features": features}})})
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with ipc.new_stream(path, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return path


# A verl-style dataset class, as a user writes it: `_read_files_and_tokenize` reads the raw Arrow
# export itself, drops the long system prompt (the small policy is not trained to follow it),
# sets self.dataframe and lets maybe_filter_out_long_prompts drop what is still too long.
EURUS_DATASET = '''
import pyarrow as pa
from verl_mcore.data import RLHFDataset


class EurusArrowDataset(RLHFDataset):
    def _read_files_and_tokenize(self):
        rows = []
        for path in self.data_files:
            with pa.memory_map(path) as source:
                rows += pa.ipc.open_stream(source).read_all().to_pylist()
        for row in rows:
            row["prompt"] = [m for m in row["prompt"] if m["role"] != "system"]
            row["extra_info"]["read_by"] = type(self).__name__
        self.dataframe = self.maybe_filter_out_long_prompts(rows)
'''
