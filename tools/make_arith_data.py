"""Write the arithmetic recipe's prompt datasets (configs/grpo_smollm2_arith.yaml and
configs/ppo_smollm2_arith.yaml read them).

    python -m tools.make_arith_data                  # -> data/arith/train.parquet, data/arith/val.parquet
    python -m tools.make_arith_data --out DIR --seed 3 --max-operand 50

The task: "What is 23 + 7? Answer with only the number." for every a + b and a - b (a >= b, so
no answer is negative) with operands in [--min-operand, --max-operand]. Every problem appears
once; a seeded shuffle puts --val-rows of them in the validation split and the rest in the
training split, so no validation question is ever trained on. The same arguments write the same
files.

SmolLM2-135M-Instruct starts weak at this (FINDINGS, "The real-model fixture"): asked through its
chat template it mostly explains ("To solve this, we need to ...") or gets the sum wrong, so
greedy accuracy under examples/arith_reward.py's strict format starts low and RL has something
to teach.

Rows use the standard layout: data_source, prompt (chat messages), ability,
reward_model {style, ground_truth (the answer as text)}, extra_info {split, index, a, op, b}.
"""
from __future__ import annotations

import argparse
import os
import random
from typing import Optional

DATA_SOURCE = "arith"
QUESTION = "What is {a} {op} {b}? Answer with only the number."


def problems(min_operand: int, max_operand: int) -> list[tuple[int, str, int]]:
    """Every (a, op, b): a + b for all ordered pairs, a - b for a >= b; in a fixed order."""
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"--min-operand {min_operand} and --max-operand {max_operand}: need "
                         f"0 <= min <= max")
    span = range(min_operand, max_operand + 1)
    return ([(a, "+", b) for a in span for b in span]
            + [(a, "-", b) for a in span for b in span if a >= b])


def row(a: int, op: str, b: int, split: str, index: int) -> dict:
    answer = a + b if op == "+" else a - b
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "a": a, "op": op, "b": b},
    }


def splits(seed: int, val_rows: int, min_operand: int = 1, max_operand: int = 12,
           train_rows: Optional[int] = None) -> dict[str, list[dict]]:
    """{"train": rows, "val": rows}: disjoint, deterministic in the arguments."""
    todo = problems(min_operand, max_operand)
    if not 0 < val_rows < len(todo):
        raise ValueError(f"--val-rows {val_rows}: operands {min_operand}..{max_operand} give "
                         f"{len(todo)} problems; the validation split needs between 1 and "
                         f"{len(todo) - 1} of them")
    random.Random(seed).shuffle(todo)
    val, train = todo[:val_rows], todo[val_rows:]
    if train_rows is not None:
        if train_rows > len(train):
            raise ValueError(f"--train-rows {train_rows}: only {len(train)} problems are left "
                             f"after the {val_rows} validation rows")
        train = train[:train_rows]
    return {"train": [row(*p, "train", i) for i, p in enumerate(train)],
            "val": [row(*p, "val", i) for i, p in enumerate(val)]}


def write(out_dir: str, data: dict[str, list[dict]]) -> dict[str, str]:
    """Each split to OUT_DIR/<split>.parquet; returns split -> path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, rows in data.items():
        paths[split] = os.path.join(out_dir, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths


def main(argv=None) -> dict[str, str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/arith", help="directory for train.parquet and val.parquet")
    p.add_argument("--seed", type=int, default=0, help="the shuffle that picks the validation rows")
    p.add_argument("--val-rows", type=int, default=64)
    p.add_argument("--train-rows", type=int, default=None, help="default: every problem left")
    p.add_argument("--min-operand", type=int, default=1)
    p.add_argument("--max-operand", type=int, default=12)
    args = p.parse_args(argv)
    try:
        data = splits(args.seed, args.val_rows, args.min_operand, args.max_operand, args.train_rows)
    except ValueError as e:
        p.error(str(e))
    paths = write(args.out, data)
    for split, path in paths.items():
        print(f"wrote {len(data[split])} {split} rows to {path}")
    return paths


if __name__ == "__main__":
    main()
