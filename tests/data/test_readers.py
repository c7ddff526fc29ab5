"""What the readers make of files that pyarrow reads in surprising ways: every value reaches the
rows as the file holds it, or the file is refused with its name (and row) in the message."""
import os

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from tests.data.files import FORMATS, gsm8k_rows, write_rows
from tests.data.tiny_tokenizer import make_tiny_tokenizer
from verl_mcore.config.schema import DataConfig
from verl_mcore.data import DataError, RLHFDataset
from verl_mcore.data.readers import read_file_rows, resolve_files


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


def late_tools_rows(n: int, late: int) -> list[dict]:
    """verl tool datasets: extra_info.tools is [] for most rows, a list of objects in the last
    `late`. The long prompts make the file span several of pyarrow.json's 1 MiB blocks."""
    rows = gsm8k_rows(n)
    for i, row in enumerate(rows):
        row["prompt"][0]["content"] += " ?" * 400
        row["extra_info"]["tools"] = [{"name": "calc"}] if i >= n - late else []
    return rows


@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_jsonl_field_empty_in_early_blocks_and_objects_later(tmp_path, tok, on_bad_row):
    path = write_rows(str(tmp_path / "tools.jsonl"), late_tools_rows(1600, 3), "jsonl")
    ds = RLHFDataset(path, tok, DataConfig(on_bad_row=on_bad_row, max_prompt_length=1024))
    assert len(ds) == 1600 and ds.stats.bad_rows_skipped == 0
    assert ds.get_batch([1599]).rows[0]["extra_info"]["tools"] == [{"name": "calc"}]
    assert ds.get_batch([0]).rows[0]["extra_info"]["tools"] == []


def test_jsonl_rows_that_do_not_form_a_table_name_the_row(tmp_path, tok):
    rows = gsm8k_rows(6)
    for row in rows:
        row["reward_model"]["ground_truth"] = "2021-03-04"  # read through Python
    rows[4]["extra_info"]["index"] = 2 ** 70  # no Arrow integer holds it
    path = write_rows(str(tmp_path / "huge.jsonl"), rows, "jsonl")
    with pytest.raises(DataError) as e:
        RLHFDataset(path, tok, DataConfig())
    assert str(e.value).startswith(f"{path}, row 4: the rows do not form one table"), e.value


def with_views(table: pa.Table) -> pa.Table:
    """`table` as polars >= 1.0 writes it to Arrow IPC: strings as string_view, nested too."""
    def view(t):
        if pa.types.is_string(t):
            return pa.string_view()
        if pa.types.is_struct(t):
            return pa.struct([f.with_type(view(f.type)) for f in t])
        if pa.types.is_list(t):
            return pa.list_(view(t.value_type))
        return t
    return table.cast(pa.schema([f.with_type(view(f.type)) for f in table.schema]))


def test_string_view_columns_read_as_strings(tmp_path, tok):
    rows = gsm8k_rows(5)
    table = with_views(pa.Table.from_pylist(rows))
    assert pa.types.is_string_view(table.schema.field("reward_model").type.field(1).type)
    path = str(tmp_path / "polars.arrow")
    with ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    for ds in (RLHFDataset(path, tok, DataConfig()),
               RLHFDataset("rows", tok, DataConfig(), rows=table)):
        assert ds.get_batch([3, 1]).rows == [rows[3], rows[1]]
        assert ds.distinct(["data_source"]) == {("openai/gsm8k",)}


def test_list_view_column_is_refused(tmp_path, tok):
    table = pa.Table.from_pylist(gsm8k_rows(3)).append_column(
        "tags", pa.array([[1], [2, 3], []], pa.list_view(pa.int64())))
    with pytest.raises(DataError, match="column 'tags': the column holds list_view"):
        RLHFDataset("rows", tok, DataConfig(), rows=table)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_invalid_utf8_is_refused_at_read(tmp_path, tok, fmt):
    rows = gsm8k_rows(4)
    path = str(tmp_path / f"bad{FORMATS[fmt]}")
    if fmt == "jsonl":
        write_rows(path, rows, "jsonl")
        data = open(path, "rb").read().replace(b'"split": "train"}', b'"split": "tr\xe9"}', 1)
        open(path, "wb").write(data)
    else:
        table = pa.Table.from_pylist(rows)
        bad = pa.array([b"openai/gsm8k"] * 3 + [b"openai/gsm8\xff"], pa.binary()).view(pa.string())
        pq.write_table(table.set_column(0, "data_source", bad), path)
    column = "extra_info" if fmt == "jsonl" else "data_source"
    with pytest.raises(DataError, match=f"column {column!r}: the column holds invalid data"):
        RLHFDataset(path, tok, DataConfig())


def test_a_directory_written_by_datasets_save_to_disk(tmp_path):
    """Its data-*.arrow files are the rows (state.json and dataset_info.json are metadata); a
    DatasetDict's directory is refused, naming its splits."""
    datasets = pytest.importorskip("datasets", reason="datasets (in the test extra) is not installed")
    rows = [{"prompt": f"p{i}", "data_source": "openai/gsm8k"} for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    files = resolve_files(str(tmp_path / "ds"))
    assert [os.path.basename(f) for f in files] == ["data-00000-of-00001.arrow"]
    assert read_file_rows(files[0]).table.to_pylist() == rows
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"a DatasetDict .* name one split's directory \(train\)"):
        resolve_files(str(tmp_path / "dd"))
