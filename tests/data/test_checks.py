"""data/checks.check_files: the preflight's data check (build.build_inputs), made before the model
is read and with no tokenizer: the files exist and open, and the first rows of each have the
columns and prompts the dataset needs; errors name the file, row and column."""
import pytest

from tests.data.files import FORMATS, gsm8k_rows, write_rows
from verl_mcore.config.schema import DataConfig
from verl_mcore.data.checks import SAMPLE_ROWS, check_files
from verl_mcore.data.errors import DataError


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bad_prompt_among_the_first_rows_is_named(tmp_path, fmt):
    rows = gsm8k_rows(10)
    rows[4]["prompt"] = []
    path = write_rows(str(tmp_path / f"train{FORMATS[fmt]}"), rows, fmt)
    with pytest.raises(DataError, match=rf"train{FORMATS[fmt]}, row 4, column 'prompt': the "
                                        r"prompt is an empty list of messages"):
        check_files([path], DataConfig())
    check_files([path], DataConfig(on_bad_row="skip"))  # left to the dataset, which skips it


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_only_the_first_rows_are_read(tmp_path, fmt):
    """A large file costs the preflight nothing: rows past the sample are the dataset's to read
    (with the tokenizer, after the model directory is checked)."""
    rows = gsm8k_rows(SAMPLE_ROWS + 10)
    rows[SAMPLE_ROWS + 5]["prompt"] = []
    check_files([write_rows(str(tmp_path / f"train{FORMATS[fmt]}"), rows, fmt)], DataConfig())


def test_files_columns_and_schemas(tmp_path):
    with pytest.raises(DataError, match=r"nope.parquet: no such file or directory"):
        check_files([str(tmp_path / "nope.parquet")], DataConfig())
    no_prompt = write_rows(str(tmp_path / "q.parquet"), [{"question": "2 + 2 ?"}], "parquet")
    with pytest.raises(DataError, match=r"q.parquet, column 'prompt': there is no prompt column"):
        check_files([no_prompt], DataConfig())
    check_files([no_prompt], DataConfig(prompt_key="question"))
    a = write_rows(str(tmp_path / "a.parquet"), gsm8k_rows(3), "parquet")
    b_rows = gsm8k_rows(3)
    for row in b_rows:
        row["category"] = 1
    b = write_rows(str(tmp_path / "b.parquet"), b_rows, "parquet")
    with pytest.raises(DataError, match=r"b.parquet, row 0, column 'category': mixed schemas: "
                                        r"number here, string in .*a.parquet"):
        check_files([a, b], DataConfig())


def test_a_custom_dataset_class_reads_its_own_files(tmp_path):
    """data.custom_cls reads the files its own way (CSV, say): only that they exist is checked."""
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "train.csv").write_text("prompt\n2 + 2 ?\n")
    check_files([str(tmp_path / "csv")], DataConfig(), read=False)
    with pytest.raises(DataError, match=r"the directory holds no file"):
        check_files([str(tmp_path / "csv")], DataConfig())
    with pytest.raises(DataError, match=r"trian.csv: no such file or directory"):
        check_files([str(tmp_path / "csv" / "trian.csv")], DataConfig(), read=False)
