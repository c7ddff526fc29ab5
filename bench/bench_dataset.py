"""Read and tokenise prompts from Parquet: how many prompts per second RLHFDataset prepares.

    python -m bench.bench_dataset                      # 100k GSM8K-like prompts, built-in tokenizer
    python -m bench.bench_dataset --tokenizer /path/to/hf_model_dir --num-prompts 20000

The prompts are synthetic GSM8K-shaped rows (a ~45-word question as one user message, plus the
usual data_source / reward_model / extra_info columns) written to a temporary Parquet file. The
tokenizer is a byte-level BPE (vocab 8000) trained here on the same kind of text, with a chat
template, unless --tokenizer names a local Hugging Face tokenizer directory.

Measured: the RLHFDataset constructor (read, row checks, chat template, tokenisation, length
check), then iterating one epoch of PromptLoader batches (shuffled, with the rows' fields).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

from tests.data.tiny_tokenizer import make_tiny_tokenizer
from verl_mcore.config.schema import DataConfig
from verl_mcore.data import PromptLoader, RLHFDataset

_NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark"]
_ITEMS = ["clips", "apples", "books", "pages", "dollars", "marbles", "cookies", "tickets", "pens"]
_VERBS = ["sold", "bought", "read", "earned", "gave away", "collected", "baked", "found"]
_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def question(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    item, verb = rng.choice(_ITEMS), rng.choice(_VERBS)
    n, m, k = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 12)
    return (f"{a} {verb} {n} {item} to {m} of her friends in April, and then {b} {verb} "
            f"{k} times as many {item} in May as {a} did in the first {m} days. If each of the "
            f"{item} costs ${k}.{m:02d}, how many {item} did they {verb.split()[0]} altogether, "
            f"and what was the total cost?")


def make_rows(num: int, seed: int = 0) -> pa.Table:
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "user", "content": f"{question(rng)} {_INSTRUCTION}"}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(rng.randint(1, 10**5))},
                     "extra_info": {"split": "train", "index": i}})
    return pa.Table.from_pylist(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=100_000)
    parser.add_argument("--tokenizer", default=None, help="a local HF tokenizer directory")
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()

    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        rng = random.Random(1)
        tok = make_tiny_tokenizer(texts=[question(rng) + " " + _INSTRUCTION for _ in range(5000)],
                                  kind="bpe", vocab_size=8000)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prompts.parquet")
        pq.write_table(make_rows(args.num_prompts), path)
        size_mb = os.path.getsize(path) / 2**20
        cfg = DataConfig(max_prompt_length=1024)
        load_before = os.getloadavg()[0]
        start, cpu_start = time.perf_counter(), time.process_time()
        ds = RLHFDataset(path, tok, cfg)
        build_s = time.perf_counter() - start
        build_cpu_s = time.process_time() - cpu_start
        tokens = int(ds._offsets[-1])
        loader = PromptLoader(ds, args.batch_size, seed=1, num_epochs=1)
        start = time.perf_counter()
        served = sum(len(batch) for batch in loader)
        iterate_s = time.perf_counter() - start
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {
        "num_prompts": len(ds), "parquet_mb": round(size_mb, 1), "tokens": tokens,
        "mean_prompt_tokens": round(tokens / len(ds), 1),
        "build_s": round(build_s, 2), "prompts_per_s": round(len(ds) / build_s),
        "tokens_per_s": round(tokens / build_s),
        # CPU seconds of this process, all threads: the number to trust on a shared machine
        "build_cpu_s": round(build_cpu_s, 2), "prompts_per_cpu_s": round(len(ds) / build_cpu_s),
        "load_average_before": load_before,
        "loader_batches_prompts_per_s": round(served / iterate_s),
        "tokenizer": args.tokenizer or "built-in byte-level BPE, vocab 8000, chat template",
        "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "commit": commit,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
