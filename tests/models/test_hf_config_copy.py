"""models/load.hf_config_copy: the HF files every actor checkpoint carries (dist/hf_config/)."""
import pytest

from verl_mcore.models import load


def _dir(path, files):
    path.mkdir()
    for name, content in files.items():
        (path / name).write_bytes(content)
    return str(path)


def test_non_weight_files_with_a_separate_tokenizers_over_them(tmp_path):
    model = _dir(tmp_path / "model", {
        "config.json": b"{model}", "generation_config.json": b"{gen}", "tokenizer.json": b"old",
        "special_tokens_map.json": b"{}", "model.safetensors": b"w", "pytorch_model.bin": b"w",
        "model.safetensors.index.json": b"{}", "tokenizer.model": b"\x00\xff binary"})
    (tmp_path / "model" / "original").mkdir()  # a subdirectory (Hub snapshots): not copied
    assert load.hf_config_copy(model) == {
        "config.json": b"{model}", "generation_config.json": b"{gen}", "tokenizer.json": b"old",
        "special_tokens_map.json": b"{}", "tokenizer.model": b"\x00\xff binary"}
    # model.tokenizer set: its tokenizer files win by name; the model's config stays.
    tok = _dir(tmp_path / "tok", {"config.json": b"{other}", "tokenizer.json": b"new",
                                   "tokenizer_config.json": b"{tc}"})
    copy = load.hf_config_copy(model, tok)
    assert copy["tokenizer.json"] == b"new" and copy["tokenizer_config.json"] == b"{tc}"
    assert copy["config.json"] == b"{model}" and copy["tokenizer.model"] == b"\x00\xff binary"
    assert load.hf_config_copy(model, model) == load.hf_config_copy(model)


def test_a_large_non_weight_file_is_left_out_and_named(tmp_path, monkeypatch, caplog):
    model = _dir(tmp_path / "model", {"config.json": b"{}", "model.onnx": b"x" * 100})
    monkeypatch.setattr(load, "MAX_METADATA_FILE_BYTES", 50)
    with caplog.at_level("WARNING", logger="verl_mcore.models.load"):
        assert load.hf_config_copy(model) == {"config.json": b"{}"}
    assert "model.onnx" in caplog.text and "not copied" in caplog.text


@pytest.mark.parametrize("name", ["model-00001-of-00002.safetensors", "model.gguf", "x.pt"])
def test_weight_files_are_not_metadata(tmp_path, name):
    assert load.metadata_files(_dir(tmp_path / "m", {name: b"w", "config.json": b"{}"})) == \
        ["config.json"]
