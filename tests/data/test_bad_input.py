"""Every kind of bad input fails before training with the file, the row and the column named;
under data.on_bad_row=skip bad rows are skipped, counted and reported."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from tests.data.files import FORMATS, gsm8k_rows, write_rows
from tests.data.tiny_tokenizer import make_tiny_tokenizer
from verl_mcore.config.schema import DataConfig
from verl_mcore.data import DataError, RLHFDataset


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def expect_error(files, tok, row, column, problem, **cfg):
    with pytest.raises(DataError) as e:
        RLHFDataset(files, tok, DataConfig(**cfg))
    message = str(e.value)
    path = files if isinstance(files, str) else files[-1]
    assert message.startswith(path), message
    if row is not None:
        assert f"row {row}," in message or message.split(": ")[0].endswith(f"row {row}"), message
    if column is not None:
        assert f"column {column!r}" in message, message
    assert problem in message, message
    return e.value


def with_prompt(rows, index, prompt):
    rows[index]["prompt"] = prompt
    return rows


# (name, rows, format, bad row, column, words in the message)
ROW_CASES = [
    ("int prompt", lambda: [dict(r, prompt=5) for r in gsm8k_rows(3)], "parquet", 0,
     "prompt", "must be a string or a list of {role, content} messages, got int"),
    ("null prompt", lambda: with_prompt(gsm8k_rows(4), 2, None), "parquet", 2, "prompt",
     "missing (null)"),
    ("empty string", lambda: [dict(r, prompt="  ") for r in gsm8k_rows(2)], "arrow_file", 0,
     "prompt", "empty string"),
    ("no role", lambda: with_prompt(gsm8k_rows(4), 3, [{"content": "hi"}]), "parquet", 3,
     "prompt", "message 0 has no 'role'"),
    ("no content", lambda: with_prompt(gsm8k_rows(3), 1, [{"role": "system", "content": "x"},
                                                          {"role": "user"}]),
     "arrow_stream", 1, "prompt", "message 1 has no 'content'"),
    ("list of strings", lambda: [dict(r, prompt=["hi", "there"]) for r in gsm8k_rows(2)],
     "parquet", 0, "prompt", "message 0 must be a {role, content} mapping"),
    ("empty messages", lambda: with_prompt(gsm8k_rows(3), 1, []), "jsonl", 1, "prompt",
     "empty list of messages"),
    ("jsonl int among strings", lambda: with_prompt([dict(r, prompt="q") for r in gsm8k_rows(4)],
                                                    2, 7),
     "jsonl", 2, "prompt", "a number (line 3) where the other rows have a string"),
    ("jsonl string among messages", lambda: with_prompt(gsm8k_rows(4), 1, "plain"), "jsonl", 1,
     "prompt", "a string (line 2) where the other rows have a list (data.prompt_key='prompt'): the "
               "prompts of a dataset are all strings or all lists of {role, content} messages"),
    ("jsonl dict prompt", lambda: with_prompt(gsm8k_rows(4), 3, {"role": "user"}), "jsonl", 3,
     "prompt", "an object (line 4) where the other rows have a list"),
    ("jsonl content not a string", lambda: with_prompt(gsm8k_rows(3), 0,
                                                       [{"role": "user", "content": 3}]),
     "jsonl", 0, "prompt", "a number at prompt[].content"),
    ("jsonl nested type change", lambda: [dict(r, extra_info={"index": "a" if i == 1 else i})
                                          for i, r in enumerate(gsm8k_rows(3))],
     "jsonl", 1, "extra_info", "a string at extra_info.index"),
    ("data_source not a string", lambda: [dict(r, data_source=1) for r in gsm8k_rows(2)],
     "parquet", 0, "data_source", "expected string, the column holds int64"),
    ("reward_model a string", lambda: [dict(r, reward_model="42") for r in gsm8k_rows(2)],
     "arrow_file", 0, "reward_model", "expected struct"),
    ("reward_model without ground_truth", lambda: [dict(r, reward_model={"style": "rule"})
                                                   for r in gsm8k_rows(2)],
     "parquet", 0, "reward_model", "no 'ground_truth' field"),
    ("extra_info a list", lambda: [dict(r, extra_info=[1, 2]) for r in gsm8k_rows(2)],
     "parquet", 0, "extra_info", "expected struct"),
]


@pytest.mark.parametrize("name,make,fmt,row,column,problem", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_bad_rows_and_columns(tmp_path, tok, name, make, fmt, row, column, problem):
    path = write_rows(str(tmp_path / f"bad{FORMATS[fmt]}"), make(), fmt)
    expect_error(path, tok, row, column, problem)


def test_jsonl_row_number_is_the_real_one_in_a_large_file(tmp_path, tok):
    # pyarrow reports rows relative to an internal block; ours count from the top of the file.
    rows = [dict(r, prompt="q " * 50) for r in gsm8k_rows(3000)]
    rows[2500]["prompt"] = 12
    path = write_rows(str(tmp_path / "big.jsonl"), rows, "jsonl")
    expect_error(path, tok, 2500, "prompt", "line 2501")


def test_missing_prompt_column_and_configurable_key(tmp_path, tok):
    path = write_rows(str(tmp_path / "q.parquet"),
                      [{"question": "How many ?", "data_source": "x"}] * 2, "parquet")
    expect_error(path, tok, None, "prompt", "there is no prompt column (data.prompt_key='prompt')")
    assert len(RLHFDataset(path, tok, DataConfig(prompt_key="question"))) == 2


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_empty_files(tmp_path, tok, fmt):
    path = tmp_path / f"empty{FORMATS[fmt]}"
    path.write_bytes(b"")
    expect_error(str(path), tok, None, None, "the file is empty (0 bytes)")


@pytest.mark.parametrize("fmt", ["parquet", "arrow_file", "arrow_stream"])
def test_files_without_rows(tmp_path, tok, fmt):
    path = str(tmp_path / f"norows{FORMATS[fmt]}")
    table = pa.Table.from_pylist(gsm8k_rows(1)).slice(0, 0)
    if fmt == "parquet":
        pq.write_table(table, path)
    else:
        with (ipc.new_file if fmt == "arrow_file" else ipc.new_stream)(path, table.schema) as w:
            w.write_table(table)
    expect_error(path, tok, None, None, "the file has no rows")


@pytest.mark.parametrize("fmt,cut", [("parquet", 0.5), ("parquet", 0.97), ("arrow_file", 0.5),
                                     ("arrow_file", 0.95), ("arrow_stream", 0.5)])
def test_truncated_binary_files(tmp_path, tok, fmt, cut):
    path = write_rows(str(tmp_path / f"t{FORMATS[fmt]}"), gsm8k_rows(30), fmt)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: int(len(data) * cut)])
    expect_error(path, tok, None, None, "truncated")


def test_arrow_stream_cut_between_batches(tmp_path, tok):
    # Reads without a pyarrow error; only the missing end-of-stream marker tells.
    path = write_rows(str(tmp_path / "s.arrows"), gsm8k_rows(9), "arrow_stream")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-8])
    expect_error(path, tok, None, None, "no end-of-stream marker")


def test_truncated_jsonl_names_the_last_row(tmp_path, tok):
    path = write_rows(str(tmp_path / "t.jsonl"), gsm8k_rows(5), "jsonl")
    data = open(path).read()
    open(path, "w").write(data[: len(data) - 40])
    expect_error(path, tok, 4, None, "invalid JSON (line 5)")


@pytest.mark.parametrize("name,content,problem", [
    ("junk.parquet", b"\x00\x01 not a parquet file", "not a Parquet, Arrow IPC"),
    ("array.json", b'[{"prompt": "hi"}]', "a JSON array is not supported"),
    ("lines.jsonl", b'{"prompt": "a"}\n[1, 2]\n', "a row must be a JSON object"),
])
def test_unreadable_files(tmp_path, tok, name, content, problem):
    (tmp_path / name).write_bytes(content)
    expect_error(str(tmp_path / name), tok, None, None, problem)


def test_unreadable_permissions(tmp_path, tok):
    path = write_rows(str(tmp_path / "locked.parquet"), gsm8k_rows(2), "parquet")
    os.chmod(path, 0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("running as root: permissions do not stop reading")
        expect_error(path, tok, None, None, "cannot open the file")
    finally:
        os.chmod(path, 0o644)


def test_mixed_schemas_across_files(tmp_path, tok):
    a = write_rows(str(tmp_path / "a.parquet"), gsm8k_rows(2), "parquet")
    no_category = [{k: v for k, v in r.items() if k != "category"} for r in gsm8k_rows(2)]
    b = write_rows(str(tmp_path / "b.parquet"), no_category, "parquet")
    err = expect_error([a, b], tok, 0, "category", "mixed schemas")
    assert a in str(err) and b in str(err)
    c = write_rows(str(tmp_path / "c.jsonl"), [dict(r, prompt="plain") for r in gsm8k_rows(2)],
                   "jsonl")
    err = expect_error([a, c], tok, 0, "prompt", "mixed schemas: string here, list<struct>")
    # int64 in one file and double in another is the same kind: not an error
    d = write_rows(str(tmp_path / "d.parquet"),
                   [dict(r, extra_info={"index": 0.5, "split": "x"}) for r in gsm8k_rows(2)],
                   "parquet")
    assert len(RLHFDataset([a, d], tok, DataConfig())) == 4


def test_skip_bad_rows_counts_and_reports(tmp_path, tok, caplog):
    good = gsm8k_rows(6)
    parquet_rows = gsm8k_rows(6)
    parquet_rows[1]["prompt"] = None
    parquet_rows[4]["prompt"] = [{"role": "user"}]
    a = write_rows(str(tmp_path / "a.parquet"), parquet_rows, "parquet")
    b = str(tmp_path / "b.jsonl")
    with open(b, "w") as f:
        for i, row in enumerate(good):
            if i == 2:
                row = dict(row, prompt=3)
            line = json.dumps(row)
            f.write((line[:20] if i == 3 else line) + "\n")
    with caplog.at_level(logging.WARNING, logger="verl_mcore.data.dataset"):
        ds = RLHFDataset([a, b], tok, DataConfig(on_bad_row="skip"))
    assert ds.stats.bad_rows_skipped == 4 and len(ds) == 8 and ds.stats.rows_read == 12
    kept = [ds.source_of(i) for i in range(len(ds))]
    assert kept == [(a, 0), (a, 2), (a, 3), (a, 5), (b, 0), (b, 1), (b, 4), (b, 5)]
    # rows after a skipped JSONL row keep their own data
    assert [r["reward_model"]["ground_truth"] for r in ds.rows(range(4, 8))] == ["0", "1", "4", "5"]
    assert "skipped 4 bad rows" in caplog.text
    for text in (f"{a}, row 1, column 'prompt'", f"{a}, row 4, column 'prompt'",
                 f"{b}, row 2, column 'prompt'", f"{b}, row 3: invalid JSON"):
        assert text in caplog.text


def test_skip_does_not_hide_column_problems(tmp_path, tok):
    path = write_rows(str(tmp_path / "a.parquet"),
                      [dict(r, data_source=3) for r in gsm8k_rows(2)], "parquet")
    expect_error(path, tok, 0, "data_source", "expected string", on_bad_row="skip")
    path = write_rows(str(tmp_path / "b.parquet"), [dict(r, prompt=3) for r in gsm8k_rows(2)],
                      "parquet")
    expect_error(path, tok, None, None, "no prompt is left: data.on_bad_row=skip skipped 2 of the "
                                        "2 rows as bad, e.g. ", on_bad_row="skip")


def test_a_filter_that_leaves_no_prompt_names_the_setting_and_the_length_needed(tmp_path, tok):
    rows = gsm8k_rows(100)
    rows[7]["prompt"] = [{"role": "user", "content": "hello " * 30}]
    path = write_rows(str(tmp_path / "a.parquet"), rows, "parquet")
    lengths = [len(RLHFDataset(path, tok, DataConfig(max_prompt_length=100)).prompt_ids(i))
               for i in range(100)]
    err = expect_error(path, tok, None, None, "no prompt is left: data.max_prompt_length=8 "
                       "(data.truncation=filter) left out 100 of the 100 rows: their prompts have "
                       f"{min(lengths)} to {max(lengths)} tokens after the chat template",
                       max_prompt_length=8, truncation="filter")
    assert f"raise data.max_prompt_length to at least {min(lengths)} ({max(lengths)} keeps every " \
           "prompt), or set data.truncation=truncate_left" in str(err)
    # a too-long row and bad rows together: both settings are named
    rows = [dict(r, prompt=None) for r in gsm8k_rows(3)] + gsm8k_rows(1)
    path = write_rows(str(tmp_path / "b.parquet"), rows, "parquet")
    expect_error(path, tok, None, None, "left out 1 of the 4 rows: their prompts have "
                 f"{min(lengths)} tokens after the chat template; data.on_bad_row=skip skipped 3 of "
                 "the 4 rows as bad", max_prompt_length=8, truncation="filter", on_bad_row="skip")
    (tmp_path / "c.jsonl").write_text('{"prompt": "cut\n[1]\n{"prompt": "cut too\n')
    expect_error(str(tmp_path / "c.jsonl"), tok, None, None, "data.on_bad_row=skip skipped every "
                 "row of the file as bad (3 rows), e.g. ", on_bad_row="skip")


@pytest.mark.parametrize("column,map_type", [
    ("reward_model", pa.map_(pa.string(), pa.string())),
    ("extra_info", pa.struct([("tools", pa.map_(pa.string(), pa.int64()))]))])
def test_map_columns_are_refused(tmp_path, tok, column, map_type):
    # A map reaches the reward function as a list of (key, value) pairs, not a dict.
    rows = gsm8k_rows(2)
    values = ([[("style", "rule"), ("ground_truth", "1")]] * 2 if column == "reward_model"
              else [{"tools": [("calc", 1)]}] * 2)
    table = pa.Table.from_pylist(rows).set_column(
        list(rows[0]).index(column), column, pa.array(values, map_type))
    path = str(tmp_path / "maps.parquet")
    pq.write_table(table, path)
    expect_error(path, tok, 0, column, "a map (e.g. Spark's MapType) is not supported here")


SYSTEM_THEN_USER = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
TEMPLATES = [  # (chat template, words of its message)
    ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
     "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
     "{{ m['content'] }}{% endfor %}", "Conversation roles must alternate"),
    ("{% for m in messages %}{{ m['content'] }", "TemplateSyntaxError"),
    ("{% for m in messages %}{{ m['content'] + m.name }}{% endfor %}", "UndefinedError"),
]


@pytest.mark.parametrize("template,problem", TEMPLATES, ids=["raises", "syntax", "missing key"])
def test_chat_template_errors_are_bad_rows(tmp_path, template, problem):
    rows = gsm8k_rows(4)
    rows[2]["prompt"] = SYSTEM_THEN_USER
    path = write_rows(str(tmp_path / "t.parquet"), rows, "parquet")
    tok = make_tiny_tokenizer()
    tok.chat_template = template
    e = expect_error(path, tok, None, "prompt", problem)
    assert "the tokenizer's chat template fails on this prompt" in str(e)
    if problem.startswith("Conversation"):  # only the system-first row fails this one
        assert e.row == 2
        ds = RLHFDataset(path, tok, DataConfig(on_bad_row="skip"))
        assert len(ds) == 3 and ds.stats.bad_rows_skipped == 1


_EXITS_ONLY_IN_THE_TRAINER = """import os, sys
if os.environ.get("TRAINER_PID") == str(os.getpid()):
    {exit}
from verl_mcore.data import RLHFDataset
class Mine(RLHFDataset):
    pass
"""


@pytest.mark.parametrize("exit_call, said", [("os._exit(4)", "os._exit(4)"),
                                             ("sys.exit(5)", "SystemExit: 5")])
def test_a_dataset_file_that_exits_only_in_the_trainer_is_named(tmp_path, exit_call, said):
    """data.custom_cls's probe imports the file in a process of its own; the trainer imports it
    again, where an exit met only there ended the run without a word (exit code 4, no message).
    Run in a child: unguarded, it would end pytest."""
    path = tmp_path / "mine.py"
    path.write_text(_EXITS_ONLY_IN_THE_TRAINER.format(exit=exit_call))
    script = ("import os\nos.environ['TRAINER_PID'] = str(os.getpid())\n"
              "from verl_mcore.config.schema import DataConfig, CustomClassConfig\n"
              "from verl_mcore.data.dataset import load_dataset_class\n"
              f"cfg = DataConfig(custom_cls=CustomClassConfig(path={str(path)!r}, name='Mine'))\n"
              "try:\n    load_dataset_class(cfg)\n"
              "except ValueError as e:\n    print(f'raised: {e}')\n")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(root)))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "raised: data.custom_cls" in run.stdout and str(path) in run.stdout, run.stdout
    assert said in run.stdout, run.stdout
