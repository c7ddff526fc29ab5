"""What the readers make of files that pyarrow reads in surprising ways: every value reaches the
rows as the file holds it, or the file is refused with its name (and row) in the message."""
import pytest

from tests.data.files import gsm8k_rows, write_rows
from tests.data.tiny_tokenizer import make_tiny_tokenizer
from verl_mcore.config.schema import DataConfig
from verl_mcore.data import RLHFDataset


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def test_jsonl_date_like_strings_stay_strings(tmp_path, tok):
    # pyarrow.json infers timestamps from such strings; the scorer must get the file's text.
    rows = gsm8k_rows(3)
    for row in rows:
        row["reward_model"]["ground_truth"] = "2021-03-04"
        row["extra_info"]["seen"] = ["2020-01-02 03:04:05"]
    path = write_rows(str(tmp_path / "dates.jsonl"), rows, "jsonl")
    ds = RLHFDataset(path, tok, DataConfig())
    got = ds.get_batch([0, 2]).rows
    assert [r["reward_model"]["ground_truth"] for r in got] == ["2021-03-04"] * 2
    assert got[0]["extra_info"]["seen"] == ["2020-01-02 03:04:05"]
