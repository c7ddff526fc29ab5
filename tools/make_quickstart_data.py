"""Write the quickstart task's Parquet files (they are shipped in examples/data/).

    python -m tools.make_quickstart_data --out examples/data

Rows use the standard layout: data_source, prompt (chat messages), ability,
reward_model {style, ground_truth}, extra_info.
"""
from __future__ import annotations

import argparse
import os
import random


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        d = str(rng.randrange(10)) if n > 10 else str(i % 10)
        out.append({
            "data_source": "quickstart/repeat_digit",
            "prompt": [{"role": "user", "content": f"repeat the digit {d} : "}],
            "ability": "copy",
            "reward_model": {"style": "rule", "ground_truth": d},
            "extra_info": {"split": "train" if n > 10 else "val", "index": i},
        })
    return out


def main(argv=None) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="examples/data")
    p.add_argument("--train-rows", type=int, default=512)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, table in [("quickstart_train.parquet", rows(args.train_rows, seed=0)),
                        ("quickstart_val.parquet", rows(10, seed=1))]:
        pq.write_table(pa.Table.from_pylist(table), os.path.join(args.out, name))
        print(f"wrote {len(table)} rows to {os.path.join(args.out, name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
