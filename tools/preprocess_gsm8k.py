"""Turn the public GSM8K release into verl_mcore's prompt dataset layout.

    python -m tools.preprocess_gsm8k --input gsm8k/train.jsonl --input gsm8k/test.jsonl \
        --out-dir data/gsm8k           # -> data/gsm8k/train.parquet, data/gsm8k/test.parquet

Input: the release's `question` / `answer` rows, as JSON Lines (github.com/openai/grade-school-math)
or Parquet (the Hugging Face `openai/gsm8k` files, e.g. main/train-00000-of-00001.parquet). The
split is taken from the file name (train / test), else its stem.

Output rows (Parquet, one file per split):
  data_source   "openai/gsm8k" (picks the built-in GSM8K reward)
  prompt        [{"role": "user", "content": question + INSTRUCTION}]
  ability       "math"
  reward_model  {"style": "rule", "ground_truth": the number after "####", commas removed}
  extra_info    {"split", "index", "question", "answer"} (the original worked answer)
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from verl_mcore.data.errors import DataError
from verl_mcore.data.readers import read_file_rows

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
_FINAL = re.compile(r"####\s*(-?[0-9.,]+)")


def final_answer(answer: str) -> Optional[str]:
    """'... #### 1,234' -> '1234'."""
    found = _FINAL.search(answer)
    return found.group(1).replace(",", "").rstrip(".") if found else None


def split_name(path: str) -> str:
    stem = os.path.basename(path).split(".")[0]
    for split in ("train", "test"):
        if split in stem.lower():
            return split
    return stem


def convert(path: str, split: str) -> list[dict]:
    table = read_file_rows(path).table
    for column in ("question", "answer"):
        if column not in table.column_names:
            raise DataError(path, f"not a GSM8K file: the columns are {table.column_names}",
                            column=column)
    rows = []
    for index, (question, answer) in enumerate(zip(table.column("question").to_pylist(),
                                                   table.column("answer").to_pylist())):
        truth = final_answer(answer) if isinstance(answer, str) else None
        if truth is None:
            raise DataError(path, "the answer has no final '#### <number>'", row=index,
                            column="answer")
        if not isinstance(question, str) or not question.strip():
            raise DataError(path, "the question is missing or empty", row=index, column="question")
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
        })
    return rows


def main(argv: Optional[list[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", action="append", required=True,
                        help="a GSM8K release file (.jsonl or .parquet); repeat for several splits")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    written = []
    for path in args.input:
        split = split_name(path)
        out = os.path.join(args.out_dir, f"{split}.parquet")
        if out in written:
            raise SystemExit(f"two inputs map to split {split!r} ({out}); give one file per split")
        rows = convert(path, split)
        pq.write_table(pa.Table.from_pylist(rows), out)
        print(f"{path}: {len(rows)} prompts -> {out}")
        written.append(out)
    return written


if __name__ == "__main__":
    try:
        main()
    except DataError as e:
        sys.exit(f"error: {e}")
