"""verl-style custom datasets: `_read_files_and_tokenize` setting `self.dataframe` (a pyarrow
Table, datasets.Dataset, pandas DataFrame or list of dicts), `maybe_filter_out_long_prompts`,
and the warning for a subclass whose overrides nothing calls."""
import logging

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from tests.data.files import (EURUS_DATASET, eurus_rows, gsm8k_rows, write_raw_arrow_export,
                              write_rows)
from tests.data.tiny_tokenizer import make_tiny_tokenizer
from verl_mcore.config.schema import CustomClassConfig, DataConfig
from verl_mcore.data import DataError, RLHFDataset, build_dataset

KINDS = ["arrow", "list", "datasets", "pandas"]
QUICK = [(f"repeat the digit {d} :", str(d)) for d in range(10)]
LONG_MATH = [("Let's think step by step and output the final answer after \"####\" . " * 2, "4")] * 3


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def as_kind(table: pa.Table, kind: str):
    """`table`'s rows as the frame type `kind` (skipping when its library is not installed)."""
    if kind == "arrow":
        return table
    if kind == "list":
        return table.to_pylist()
    if kind == "datasets":
        return pytest.importorskip("datasets", reason="datasets (in the test extra) is not installed: this frame type cannot be built").Dataset(table)
    return pytest.importorskip("pandas", reason="pandas (in the test extra) is not installed: this frame type cannot be built").DataFrame(table.to_pylist())


def kind_of(frame) -> str:
    return {pa.Table: "arrow", list: "list"}.get(type(frame), type(frame).__module__.split(".")[0])


class FrameDataset(RLHFDataset):
    """Sets self.dataframe to the files' rows as `kind`, optionally through the filter."""

    kind, use_filter, seen = "arrow", False, []

    def _read_files_and_tokenize(self):
        tables = [pa.ipc.open_stream(pa.memory_map(p)).read_all() for p in self.data_files]
        frame = as_kind(pa.concat_tables(tables), self.kind)
        if self.use_filter:
            filtered = self.maybe_filter_out_long_prompts(frame)
            type(self).seen.append((kind_of(frame), kind_of(filtered), len(filtered)))
            frame = filtered
        self.dataframe = frame


def frame_class(kind, use_filter=False):
    return type(f"{kind.title()}Dataset", (FrameDataset,), {"kind": kind, "use_filter": use_filter,
                                                            "seen": []})


@pytest.mark.parametrize("kind", KINDS)
def test_every_frame_type_tokenises_as_the_files_do(tmp_path, tok, kind):
    rows = gsm8k_rows(7)
    raw = write_raw_arrow_export(str(tmp_path / "raw.arrow"), rows)
    reference = RLHFDataset(write_rows(str(tmp_path / "a.parquet"), rows, "parquet"), tok,
                            DataConfig())
    ds = frame_class(kind)(raw, tok, DataConfig())
    assert len(ds) == len(reference) == 7
    assert [ds.prompt_ids(i) for i in range(7)] == [reference.prompt_ids(i) for i in range(7)]
    assert ds.get_batch([5, 0]).rows == reference.get_batch([5, 0]).rows
    assert ds.source_of(3) == (f"{kind.title()}Dataset.dataframe (read from {raw})", 3)
    assert ds.stats.rows_read == 7


@pytest.mark.parametrize("kind", KINDS)
def test_maybe_filter_out_long_prompts_returns_the_type_it_got(tmp_path, tok, kind):
    raw = write_raw_arrow_export(str(tmp_path / "raw.arrow"),
                                 eurus_rows(QUICK[:2] + LONG_MATH[:1] + QUICK[2:4], "copy"))
    cls = frame_class(kind, use_filter=True)
    cfg = DataConfig(max_prompt_length=60, truncation="filter")
    ds = cls(raw, tok, cfg)
    assert cls.seen == [(kind_of(as_kind(pa.table({"x": [1]}), kind)),) * 2 + (4,)]
    assert len(ds) == 4 and ds.stats.too_long_filtered == 1 and ds.stats.rows_read == 5
    assert [r["reward_model"]["ground_truth"] for r in ds.rows(range(4))] == ["0", "1", "2", "3"]
    # Without data.truncation=filter the frame comes back untouched and the policy applies later.
    cls.seen.clear()
    with pytest.raises(DataError, match=r"\.dataframe \(read from .*raw\.arrow\), row 2, column "
                                        r"'prompt': the prompt has \d+ tokens"):
        cls(raw, tok, DataConfig(max_prompt_length=60))
    assert cls.seen == [(cls.seen[0][0],) * 2 + (5,)]


def test_bad_rows_are_named_by_their_row_of_the_frame(tmp_path, tok):
    rows = gsm8k_rows(5)
    rows[1]["prompt"] = [{"role": "user", "content": "hello " * 40}]  # too long: filtered first
    rows[3]["prompt"] = [{"role": "user"}]
    raw = write_raw_arrow_export(str(tmp_path / "raw.arrow"), rows)
    cls = frame_class("list", use_filter=True)
    # The row named is the one of the frame given to the filter, though a row before it went.
    with pytest.raises(DataError, match=r"ListDataset\.dataframe \(read from .*\), row 3, column "
                                        r"'prompt': message 0 has no 'content'"):
        cls(raw, tok, DataConfig(max_prompt_length=20, truncation="filter"))
    ds = cls(raw, tok, DataConfig(max_prompt_length=20, truncation="filter", on_bad_row="skip"))
    assert len(ds) == 3 and ds.stats.bad_rows_skipped == 1 and ds.stats.too_long_filtered == 1
    assert ds.bad_rows[0].row == 3 and ds.stats.rows_read == 5
    # Without the filter, the tokenising pass names the same row.
    with pytest.raises(DataError, match=r"ListDataset\.dataframe .*, row 3, column 'prompt'"):
        frame_class("list")(raw, tok, DataConfig(max_prompt_length=100))


class KeepsCode(RLHFDataset):
    """A user's own filter, which here keeps nothing."""

    def _read_files_and_tokenize(self):
        super()._read_files_and_tokenize()
        self.dataframe = self.dataframe.filter(pc.equal(self.dataframe["category"], "code"))


class ReadsNothing(RLHFDataset):
    def read_file(self, path):
        return []


def test_a_filter_that_leaves_no_row_is_named(tmp_path, tok):
    raw = write_raw_arrow_export(str(tmp_path / "raw.arrow"), eurus_rows(QUICK))
    # maybe_filter_out_long_prompts: the setting, how many, and the length that would keep some
    with pytest.raises(DataError) as e:
        frame_class("list", use_filter=True)(raw, tok, DataConfig(max_prompt_length=8,
                                                                  truncation="filter"))
    msg = str(e.value)
    assert msg.startswith(f"ListDataset.dataframe (read from {raw}): no prompt is left: "
                          "maybe_filter_out_long_prompts with data.max_prompt_length=8 "
                          "(data.truncation=filter) left out 10 of the 10 rows"), msg
    assert "raise data.max_prompt_length to at least " in msg
    # the user's own filter: the class and its file
    path = write_rows(str(tmp_path / "a.parquet"), gsm8k_rows(3), "parquet")
    with pytest.raises(DataError, match=r"the dataframe has no rows: KeepsCode."
                                        r"_read_files_and_tokenize \(.*test_verl_dataset.py\) "
                                        r"kept none of the rows of 1 file"):
        KeepsCode(path, tok, DataConfig())
    with pytest.raises(DataError, match=rf"{path}: ReadsNothing.read_file \(.*test_verl_dataset"
                                        r".py\) returned no rows for this file"):
        ReadsNothing(path, tok, DataConfig())


@pytest.mark.parametrize("kind", ["list", "pandas", "pandas from arrow"])
def test_a_prompt_column_of_strings_and_messages_names_the_row(tmp_path, tok, kind):
    rows = gsm8k_rows(6)
    if kind != "list":
        pd = pytest.importorskip("pandas", reason="pandas (in the test extra) is not installed: "
                                                  "this frame type cannot be built")
    if kind == "pandas from arrow":  # list columns come back as numpy arrays
        frame = pa.Table.from_pylist(rows).to_pandas()
        frame.at[3, "prompt"] = "a plain string"
    else:
        rows[3]["prompt"] = "a plain string"
        frame = rows if kind == "list" else pd.DataFrame(rows)

    class Mixed(RLHFDataset):
        def _read_files_and_tokenize(self):
            self.dataframe = frame

    path = write_rows(str(tmp_path / "a.parquet"), gsm8k_rows(1), "parquet")
    with pytest.raises(DataError) as e:
        Mixed(path, tok, DataConfig())
    assert str(e.value).startswith(
        f"Mixed.dataframe (read from {path}), row 3, column 'prompt': a string where the other "
        "rows have a list (data.prompt_key='prompt'): the prompts of a dataset are all strings "
        "or all lists of {role, content} messages"), str(e.value)


class NoFrame(RLHFDataset):
    def _read_files_and_tokenize(self):
        self.rows_i_read = []


class DictFrame(RLHFDataset):
    def _read_files_and_tokenize(self):
        self.dataframe = {"prompt": ["hello world"]}


class NoPromptFrame(RLHFDataset):
    def _read_files_and_tokenize(self):
        self.dataframe = [{"question": "hello world"}]


@pytest.mark.parametrize("cls,problem", [
    (NoFrame, "NoFrame._read_files_and_tokenize set no self.dataframe"),
    (DictFrame, r"DictFrame.dataframe is builtins.dict; it must be a pyarrow Table, a "
                r"datasets.Dataset, a pandas DataFrame or a list of row dicts"),
    (NoPromptFrame, r"NoPromptFrame.dataframe \(read from .*\), column 'prompt': there is no "
                    r"prompt column"),
])
def test_a_frame_that_cannot_be_used_is_named(tmp_path, tok, cls, problem):
    path = write_rows(str(tmp_path / "a.parquet"), gsm8k_rows(2), "parquet")
    with pytest.raises(DataError, match=problem):
        cls(path, tok, DataConfig())


def test_dataset_dict_asks_for_a_split(tmp_path, tok):
    datasets = pytest.importorskip("datasets", reason="datasets (in the test extra) is not installed: this frame type cannot be built")

    class SplitsFrame(RLHFDataset):
        def _read_files_and_tokenize(self):
            self.dataframe = datasets.DatasetDict(
                {"train": datasets.Dataset.from_list(gsm8k_rows(2))})

    path = write_rows(str(tmp_path / "a.parquet"), gsm8k_rows(2), "parquet")
    with pytest.raises(DataError, match=r"a datasets.DatasetDict \(splits \['train'\]\); use one"):
        SplitsFrame(path, tok, DataConfig())


class ReshapeDefault(RLHFDataset):
    """verl's other pattern: the default reading, then a change to self.dataframe."""

    def _read_files_and_tokenize(self):
        super()._read_files_and_tokenize()
        frame = self.dataframe
        self.dataframe = frame.filter(pc.equal(frame["category"], "code"))


class ReadOnlyDefault(RLHFDataset):
    def _read_files_and_tokenize(self):
        super()._read_files_and_tokenize()
        self.dataframe = self.maybe_filter_out_long_prompts(self.dataframe)


def test_super_then_reshape(tmp_path, tok):
    write_rows(str(tmp_path / "d" / "a.parquet"), gsm8k_rows(3), "parquet")
    write_rows(str(tmp_path / "d" / "b.jsonl"), gsm8k_rows(2, start=3, category="code"), "jsonl")
    ds = ReshapeDefault(str(tmp_path / "d"), tok, DataConfig())
    assert [r["extra_info"]["index"] for r in ds.rows(range(len(ds)))] == [3, 4]
    # An unchanged default frame keeps each row's own file and row for messages.
    same = ReadOnlyDefault(str(tmp_path / "d"), tok, DataConfig())
    assert len(same) == 5 and same.source_of(4) == (str(tmp_path / "d" / "b.jsonl"), 1)


def _custom(tmp_path, source, name):
    (tmp_path / "my_data.py").write_text(source)
    return CustomClassConfig(path=str(tmp_path / "my_data.py"), name=name)


def test_custom_cls_trains_on_the_subclass_rows(tmp_path, tok):
    raw = write_raw_arrow_export(str(tmp_path / "eurus" / "train.arrow"),
                                 eurus_rows(QUICK) + eurus_rows(LONG_MATH, "math", "numina_olympiads"))
    cfg = DataConfig(max_prompt_length=16, truncation="filter",
                     custom_cls=_custom(tmp_path, EURUS_DATASET, "EurusArrowDataset"))
    ds = build_dataset(str(tmp_path / "eurus"), tok, cfg)
    assert type(ds).__name__ == "EurusArrowDataset" and len(ds) == len(QUICK)
    assert ds.stats.too_long_filtered == len(LONG_MATH) and ds.stats.rows_read == 13
    rows = ds.get_batch(range(len(ds))).rows
    assert {r["extra_info"]["read_by"] for r in rows} == {"EurusArrowDataset"}
    assert all([m["role"] for m in r["prompt"]] == ["user"] for r in rows)
    # ... tokenised as the same prompts without the system message are from a file
    user_only = [dict(r, prompt=r["prompt"][1:]) for r in eurus_rows(QUICK)]
    reference = RLHFDataset(write_rows(str(tmp_path / "u.parquet"), user_only, "parquet"), tok,
                            DataConfig(max_prompt_length=16))
    assert [ds.prompt_ids(i) for i in range(len(ds))] == [reference.prompt_ids(i)
                                                          for i in range(len(reference))]
    # The default reader keeps none of these rows: the system prompt makes each one too long.
    with pytest.raises(DataError, match=r"no prompt is left: data.max_prompt_length=16 \(data."
                                        r"truncation=filter\) left out 13 of the 13 rows: their "
                                        r"prompts have \d+ to \d+ tokens"):
        RLHFDataset(raw, tok, DataConfig(max_prompt_length=16, truncation="filter"))


HOOKLESS = '''
from verl_mcore.data import RLHFDataset

class Renamed(RLHFDataset):
    extensions = (".arrow",)

class VerlGetItem(RLHFDataset):
    def _build_messages(self, example):
        return example["prompt"]

    def __getitem__(self, item):
        return super().__getitem__(item)

class ReadsFiles(RLHFDataset):
    def read_file(self, path):
        return super().read_file(path)

class ReadsFrame(RLHFDataset):
    def _read_files_and_tokenize(self):
        super()._read_files_and_tokenize()

class Grandchild(ReadsFrame):
    pass
'''


@pytest.mark.parametrize("name,warned", [
    ("Renamed", "it overrides neither read_file nor _read_files_and_tokenize"),
    ("VerlGetItem", "it defines __getitem__, _build_messages, which verl_mcore never calls"),
    ("ReadsFiles", None), ("ReadsFrame", None), ("Grandchild", None)])
def test_warning_for_overrides_nothing_calls(tmp_path, tok, caplog, name, warned):
    path = write_rows(str(tmp_path / "a.arrow"), gsm8k_rows(2), "arrow_file")
    cfg = DataConfig(custom_cls=_custom(tmp_path, HOOKLESS, name))
    with caplog.at_level(logging.WARNING, logger="verl_mcore.data.dataset"):
        build_dataset(path, tok, cfg)
        build_dataset(path, tok, cfg)  # train and validation: one warning
    messages = [r.getMessage() for r in caplog.records if r.name == "verl_mcore.data.dataset"]
    if warned is None:
        assert messages == []
        return
    assert len(messages) == 1, messages
    assert f"data.custom_cls ({cfg.custom_cls.path}): {name} is read exactly as RLHFDataset" in messages[0]
    assert warned in messages[0]
    assert "read_file(path)" in messages[0] and "_read_files_and_tokenize()" in messages[0]


def test_verl_code_reading_with_datasets(tmp_path, tok):
    """What verl users write: datasets.Dataset.from_file on the raw export, map, then the filter."""
    datasets = pytest.importorskip("datasets", reason="datasets (in the test extra) is not installed: this frame type cannot be built")

    class FromFile(RLHFDataset):
        def _read_files_and_tokenize(self):
            frames = [datasets.Dataset.from_file(path) for path in self.data_files]
            self.dataframe = datasets.concatenate_datasets(frames)
            self.dataframe = self.dataframe.map(lambda row: {"prompt": row["prompt"][1:]})
            self.dataframe = self.maybe_filter_out_long_prompts(self.dataframe)

    raw = write_raw_arrow_export(str(tmp_path / "raw.arrow"),
                                 eurus_rows(QUICK) + eurus_rows(LONG_MATH, "math"))
    ds = FromFile(raw, tok, DataConfig(max_prompt_length=16, truncation="filter"))
    assert isinstance(ds.dataframe, datasets.Dataset)
    assert len(ds) == len(QUICK) and ds.stats.too_long_filtered == len(LONG_MATH)
    assert [r["reward_model"]["ground_truth"] for r in ds.rows(range(len(ds)))] == [a for _, a in QUICK]


class VerlSignature(RLHFDataset):
    """A subclass as verl users write one: verl's __init__ signature, passed on to super(), and
    the config read with DictConfig's .get."""

    def __init__(self, data_files, tokenizer, config, processor=None, max_samples=-1):
        self.filter_overlong = config.get("filter_overlong_prompts", True)  # not a key here
        self.length = config.get("max_prompt_length")
        super().__init__(data_files, tokenizer, config, processor, max_samples)


def test_verl_init_signature_and_config_get(tmp_path, tok):
    files = write_rows(str(tmp_path / "a.parquet"), gsm8k_rows(5), "parquet")
    ds = VerlSignature(files, tok, DataConfig(max_prompt_length=77))
    assert len(ds) == 5 and ds.filter_overlong is True and ds.length == 77
    with pytest.raises(DataError, match="processor=object: multimodal processors are not supported"):
        VerlSignature(files, tok, DataConfig(), object())


@pytest.mark.parametrize("shuffle", [False, True])
def test_max_samples_keeps_verls_rows(tmp_path, tok, shuffle):
    """verl: the first max_samples rows, or with shuffle numpy's default_rng(seed).choice of
    them; over two files, each row's file and row number kept."""
    import numpy as np

    rows = gsm8k_rows(12)
    files = [write_rows(str(tmp_path / "a.parquet"), rows[:7], "parquet"),
             write_rows(str(tmp_path / "b.parquet"), rows[7:], "parquet")]
    cfg = DataConfig(shuffle=shuffle, seed=5)
    ds = RLHFDataset(files, tok, cfg, None, 4)
    full = RLHFDataset(files, tok, cfg)
    chosen = (sorted(np.random.default_rng(5).choice(12, 4, replace=False)) if shuffle
              else [0, 1, 2, 3])
    assert len(ds) == 4
    assert [ds.prompt_ids(i) for i in range(4)] == [full.prompt_ids(int(j)) for j in chosen]
    assert [ds.source_of(i) for i in range(4)] == [full.source_of(int(j)) for j in chosen]
    assert len(RLHFDataset(files, tok, cfg, None, 50)) == 12  # more than there are: all
