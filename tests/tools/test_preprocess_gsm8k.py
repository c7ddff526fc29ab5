"""tools/preprocess_gsm8k.py on a tiny GSM8K-like release made here (no downloads)."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.data.tiny_tokenizer import make_tiny_tokenizer
from tools.preprocess_gsm8k import INSTRUCTION, final_answer, main
from verl_mcore.config.schema import DataConfig
from verl_mcore.data import DataError, RLHFDataset
from verl_mcore.reward import default_compute_score

RELEASE = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                 "many clips in May. How many clips did Natalia sell altogether?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\n48+24 = <<48+24=72>>72\n#### 72"},
    {"question": "A shop sells 1,250 pens a day. How many in 2 days?",
     "answer": "1,250 * 2 = <<1250*2=2500>>2,500\n#### 2,500"},
    {"question": "It was 5 degrees and fell by 8. What is it now?",
     "answer": "5 - 8 = -3\n#### -3"},
]


def test_final_answer():
    assert final_answer("x\n#### 2,500") == "2500" and final_answer("#### -3") == "-3"
    assert final_answer("no final answer") is None


def test_jsonl_and_parquet_release_to_dataset_layout(tmp_path):
    src = tmp_path / "release"
    src.mkdir()
    with open(src / "train.jsonl", "w") as f:
        for row in RELEASE:
            f.write(json.dumps(row) + "\n")
    pq.write_table(pa.Table.from_pylist(RELEASE[:2]), src / "test-00000-of-00001.parquet")
    out = main(["--input", str(src / "train.jsonl"),
                "--input", str(src / "test-00000-of-00001.parquet"),
                "--out-dir", str(tmp_path / "out")])
    assert out == [str(tmp_path / "out" / "train.parquet"), str(tmp_path / "out" / "test.parquet")]
    ds = RLHFDataset(out[0], make_tiny_tokenizer(), DataConfig(max_prompt_length=256))
    rows = ds.rows(range(len(ds)))
    assert len(rows) == 3
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["prompt"] == [{"role": "user", "content": RELEASE[0]["question"] + " " + INSTRUCTION}]
    assert [r["reward_model"] for r in rows] == [{"style": "rule", "ground_truth": t}
                                                  for t in ("72", "2500", "-3")]
    assert first["extra_info"] == {"split": "train", "index": 0, "question": RELEASE[0]["question"],
                                   "answer": RELEASE[0]["answer"]}
    assert pq.read_table(out[1]).column("extra_info").to_pylist()[1]["split"] == "test"
    # the built-in reward accepts the release's own worked answers
    for row, release in zip(rows, RELEASE):
        assert default_compute_score(row["data_source"], release["answer"],
                                     row["reward_model"]["ground_truth"]) == 1.0


def test_bad_release_rows_name_file_row_column(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(RELEASE[0]) + "\n" + json.dumps({"question": "q", "answer": "42"}) + "\n")
    with pytest.raises(DataError, match=r"train\.jsonl, row 1, column 'answer': the answer has no"):
        main(["--input", str(path), "--out-dir", str(tmp_path / "out")])
    path.write_text(json.dumps({"prompt": "q"}) + "\n")
    with pytest.raises(DataError, match=r"train\.jsonl, column 'question': not a GSM8K file"):
        main(["--input", str(path), "--out-dir", str(tmp_path / "out")])
