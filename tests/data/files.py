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
