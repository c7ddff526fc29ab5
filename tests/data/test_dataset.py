"""Prompt rendering (chat template or plain text), length policies, and custom dataset classes."""
import textwrap

import pytest

from tests.data.files import gsm8k_rows, write_rows
from tests.data.tiny_tokenizer import make_tiny_tokenizer
from verl_mcore.config.schema import CustomClassConfig, DataConfig
from verl_mcore.data import DataError, RLHFDataset, build_dataset


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def plain_tok():
    return make_tiny_tokenizer(chat_template=False)


def tokens(tok, ids):
    return tok.convert_ids_to_tokens(ids)


def test_chat_template_applied_with_generation_prompt(tmp_path, tok):
    rows = gsm8k_rows(1)
    rows[0]["prompt"] = [{"role": "system", "content": "hello world"},
                         {"role": "user", "content": "How many clips ?"}]
    ds = RLHFDataset(write_rows(str(tmp_path / "a.parquet"), rows, "parquet"), tok, DataConfig())
    assert tokens(tok, ds.prompt_ids(0)) == [
        "<s>", "<|system|>", "hello", "world", "</s>", "<|user|>", "How", "many", "clips", "?",
        "</s>", "<|assistant|>"]


def test_string_prompt_becomes_a_user_message(tmp_path, tok):
    rows = [dict(r, prompt="How many clips ?") for r in gsm8k_rows(1)]
    ds = RLHFDataset(write_rows(str(tmp_path / "a.jsonl"), rows, "jsonl"), tok, DataConfig())
    assert tokens(tok, ds.prompt_ids(0)) == ["<s>", "<|user|>", "How", "many", "clips", "?",
                                              "</s>", "<|assistant|>"]


def test_plain_text_without_template(tmp_path, tok, plain_tok):
    rows = gsm8k_rows(2)
    rows[0]["prompt"] = [{"role": "system", "content": "hello"}, {"role": "user", "content": "world"}]
    path = write_rows(str(tmp_path / "a.parquet"), rows, "parquet")
    ds = RLHFDataset(path, plain_tok, DataConfig())
    # messages joined by newlines; the tokenizer adds its BOS
    assert tokens(plain_tok, ds.prompt_ids(0)) == ["<s>", "hello", "world"]
    off = RLHFDataset(path, tok, DataConfig(apply_chat_template=False))
    assert off.prompt_ids(0) == ds.prompt_ids(0)


class SlowTokenizer:
    """A tokenizer without a Rust backend (like transformers' slow tokenizers)."""

    def __init__(self, inner):
        self.inner, self.chat_template = inner, inner.chat_template

    def __call__(self, texts, **kw):
        return self.inner(texts, **kw)

    def apply_chat_template(self, *a, **kw):
        return self.inner.apply_chat_template(*a, **kw)


@pytest.mark.parametrize("template", [True, False])
def test_tokenizer_without_rust_backend_gives_the_same_ids(tmp_path, tok, plain_tok, template):
    inner = tok if template else plain_tok
    path = write_rows(str(tmp_path / "a.parquet"), gsm8k_rows(3), "parquet")
    fast = RLHFDataset(path, inner, DataConfig())
    slow = RLHFDataset(path, SlowTokenizer(inner), DataConfig())
    assert [fast.prompt_ids(i) for i in range(3)] == [slow.prompt_ids(i) for i in range(3)]


def long_rows():
    rows = gsm8k_rows(4)
    rows[1]["prompt"] = [{"role": "user", "content": "hello " * 30}]  # 34 tokens with template
    rows[3]["prompt"] = [{"role": "user", "content": "world " * 30}]
    return rows


def test_truncation_filter_counts(tmp_path, tok):
    path = write_rows(str(tmp_path / "a.parquet"), long_rows(), "parquet")
    ds = RLHFDataset(path, tok, DataConfig(max_prompt_length=20, truncation="filter"))
    assert len(ds) == 2 and ds.stats.too_long_filtered == 2
    assert [ds.source_of(i)[1] for i in range(2)] == [0, 2]


@pytest.mark.parametrize("side", ["truncate_left", "truncate_right"])
def test_truncation_left_and_right(tmp_path, tok, side):
    path = write_rows(str(tmp_path / "a.parquet"), long_rows(), "parquet")
    full = RLHFDataset(path, tok, DataConfig(max_prompt_length=100)).prompt_ids(1)
    ds = RLHFDataset(path, tok, DataConfig(max_prompt_length=20, truncation=side))
    assert len(ds) == 4 and ds.stats.too_long_truncated == 2
    want = full[-20:] if side == "truncate_left" else full[:20]
    assert ds.prompt_ids(1) == want
    if side == "truncate_left":  # the generation prompt survives
        assert tokens(tok, ds.prompt_ids(1))[-1] == "<|assistant|>"


def test_truncation_error_names_row_and_length(tmp_path, tok):
    path = write_rows(str(tmp_path / "a.parquet"), long_rows(), "parquet")
    with pytest.raises(DataError) as e:
        RLHFDataset(path, tok, DataConfig(max_prompt_length=20))
    assert str(e.value).startswith(f"{path}, row 1, column 'prompt': the prompt has 34 tokens")
    assert "data.max_prompt_length=20" in str(e.value)


CUSTOM = textwrap.dedent('''
    import csv
    from verl_mcore.data import RLHFDataset

    class CsvDataset(RLHFDataset):
        extensions = (".csv",)

        def read_file(self, path):
            with open(path) as f:
                return [{"data_source": "openai/gsm8k",
                         "prompt": [{"role": "user", "content": r["question"] or None}],
                         "reward_model": {"style": "rule", "ground_truth": r["answer"]},
                         "topic": r["topic"]}
                        for r in csv.DictReader(f)]

    class NotADataset:
        pass
''')


def test_custom_dataset_class_from_a_file(tmp_path, tok):
    (tmp_path / "my_data.py").write_text(CUSTOM)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.csv").write_text("question,answer,topic\nHow many clips ?,72,math\n"
                                          "hello world,1,chat\n")
    (tmp_path / "d" / "ignored.parquet").write_bytes(b"not looked at: not a .csv")
    cfg = DataConfig(max_prompt_length=7, truncation="filter",
                     custom_cls=CustomClassConfig(path=str(tmp_path / "my_data.py"),
                                                  name="CsvDataset"))
    ds = build_dataset(str(tmp_path / "d"), tok, cfg)
    assert type(ds).__name__ == "CsvDataset" and isinstance(ds, RLHFDataset)
    # tokenising and the length filter are inherited: the 8-token prompt is left out
    assert len(ds) == 1 and ds.stats.too_long_filtered == 1
    assert ds.rows([0])[0]["topic"] == "chat"
    assert tokens(tok, ds.prompt_ids(0)) == ["<s>", "<|user|>", "hello", "world", "</s>",
                                              "<|assistant|>"]
    # ... and so are the row checks
    (tmp_path / "d" / "b.csv").write_text("question,answer,topic\n,3,math\n")
    with pytest.raises(DataError, match=r"b\.csv, row 0, column 'prompt': message 0 has no"):
        build_dataset(str(tmp_path / "d"), tok, cfg)


@pytest.mark.parametrize("name,problem", [("NotADataset", "must be a subclass"),
                                          ("Missing", "defines no such name")])
def test_custom_dataset_class_errors(tmp_path, tok, name, problem):
    (tmp_path / "my_data.py").write_text(CUSTOM)
    cfg = DataConfig(custom_cls=CustomClassConfig(path=str(tmp_path / "my_data.py"), name=name))
    with pytest.raises(ValueError, match=problem):
        build_dataset(str(tmp_path), tok, cfg)


def test_rows_given_in_memory_are_read_like_a_files_rows(tmp_path, tok):
    """RLHFDataset(label, ..., rows=...): the Python API's prompts, with a file's checks,
    template, tokenisation and length policy; messages name the label."""
    rows = gsm8k_rows(3)
    from_file = RLHFDataset(write_rows(str(tmp_path / "a.parquet"), rows, "parquet"), tok,
                            DataConfig())
    given = RLHFDataset("the prompts given", tok, DataConfig(), rows=rows)
    assert [given.prompt_ids(i) for i in range(3)] == [from_file.prompt_ids(i) for i in range(3)]
    assert given.get_batch([2]).rows[0]["reward_model"] == rows[2]["reward_model"]
    short = [{"prompt": [{"role": "user", "content": "hi"}]}]  # <s> <|user|> hi </s> <|assistant|>
    five = DataConfig(max_prompt_length=5, truncation="filter")
    assert len(RLHFDataset("the prompts given", tok, five, rows=rows + short)) == 1
    with pytest.raises(DataError, match="the prompts given.*no prompt column"):
        RLHFDataset("the prompts given", tok, DataConfig(), rows=[{"question": "hi"}])
