"""Every file format and every way of naming files gives the same samples."""
import os

import pytest

from tests.data.files import FORMATS, gsm8k_rows, write_rows
from tests.data.tiny_tokenizer import make_tiny_tokenizer
from verl_mcore.config.schema import DataConfig
from verl_mcore.data import DataError, RLHFDataset
from verl_mcore.data.readers import resolve_files


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_reads_every_row_and_column(tmp_path, tok, fmt):
    rows = gsm8k_rows(7)
    path = write_rows(str(tmp_path / f"train{FORMATS[fmt]}"), rows, fmt)
    ds = RLHFDataset(path, tok, DataConfig())
    assert len(ds) == 7 and ds.stats.rows_read == 7
    for i, row in enumerate(rows):
        got = ds[i]["row"]
        assert got["data_source"] == "openai/gsm8k"
        assert got["reward_model"]["ground_truth"] == str(i)
        assert got["extra_info"] == {"index": i, "split": "train"}
        assert got["category"] == "math"  # an extra column travels with the sample
        text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        assert ds.prompt_ids(i) == tok(text, add_special_tokens=False)["input_ids"]


def test_all_formats_agree(tmp_path, tok):
    rows = gsm8k_rows(5)
    results = []
    for fmt, ext in FORMATS.items():
        ds = RLHFDataset(write_rows(str(tmp_path / f"d{ext}"), rows, fmt), tok, DataConfig())
        results.append(([ds.prompt_ids(i) for i in range(5)], ds.rows(range(5))))
    assert all(r == results[0] for r in results)


def test_hf_datasets_cache_arrow_is_a_stream(tmp_path, tok):
    # HF `datasets` writes the IPC *stream* format under a .arrow name: recognised by content.
    path = write_rows(str(tmp_path / "data-00000-of-00001.arrow"), gsm8k_rows(4), "arrow_stream")
    assert len(RLHFDataset(path, tok, DataConfig())) == 4


def test_file_list_directory_and_glob(tmp_path, tok):
    write_rows(str(tmp_path / "d" / "a.parquet"), gsm8k_rows(3, 0), "parquet")
    write_rows(str(tmp_path / "d" / "b.jsonl"), gsm8k_rows(2, 3), "jsonl")
    write_rows(str(tmp_path / "d" / "sub" / "c.parquet"), gsm8k_rows(4, 5), "parquet")
    (tmp_path / "d" / "README.txt").write_text("not data")
    cfg = DataConfig()
    one = RLHFDataset(str(tmp_path / "d" / "a.parquet"), tok, cfg)
    listed = RLHFDataset([str(tmp_path / "d" / "b.jsonl"), str(tmp_path / "d" / "a.parquet")], tok, cfg)
    directory = RLHFDataset(str(tmp_path / "d"), tok, cfg)  # not recursive, skips README.txt
    pattern = RLHFDataset(str(tmp_path / "d" / "**" / "*.parquet"), tok, cfg)
    gt = lambda ds: [r["reward_model"]["ground_truth"] for r in ds.rows(range(len(ds)))]
    assert gt(one) == ["0", "1", "2"]
    assert gt(listed) == ["3", "4", "0", "1", "2"]  # list order is kept
    assert gt(directory) == ["0", "1", "2", "3", "4"]
    assert gt(pattern) == ["0", "1", "2", "5", "6", "7", "8"]
    assert directory.source_of(3) == (str(tmp_path / "d" / "b.jsonl"), 0)


@pytest.mark.parametrize("spec,problem", [("missing.parquet", "no such file"),
                                          ("nothing*.parquet", "matches no file"),
                                          ("emptydir", "holds no file")])
def test_file_specs_that_match_nothing(tmp_path, tok, spec, problem):
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataError, match=problem) as e:
        RLHFDataset(str(tmp_path / spec), tok, DataConfig())
    assert str(tmp_path / spec) in str(e.value)


def test_file_specs_with_odd_paths(tmp_path, monkeypatch):
    d = tmp_path / "d"
    a = write_rows(str(d / "sub" / "a.parquet"), gsm8k_rows(2), "parquet")
    os.symlink("..", d / "sub" / "loop")  # `**` walks it again and again
    (d / "sub" / "._a.parquet").write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # macOS copy
    literal = write_rows(str(d / "train[1].parquet"), gsm8k_rows(2), "parquet")
    monkeypatch.setenv("HOME", str(d))
    assert resolve_files(str(d / "**" / "*.parquet")) == [a, literal]
    assert resolve_files([a, str(d / "sub" / "." / "a.parquet"), "~/sub/../sub/a.parquet"]) == [a]
    assert resolve_files(literal) == [literal]  # a file, not a pattern matching "train1.parquet"
    assert resolve_files("~/sub") == [a]  # no hidden file, as with a glob
