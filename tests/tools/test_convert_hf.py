"""tools.convert_hf: bit-exact round trips, transformers loads the export, dist checkpoints load
at any TP/PP, safe output handling, and the verify command's exit codes."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.models import hf_factory, parity_bodies
from tests.multiproc import run_on_ranks
from tools.convert_hf.convert import convert_hf_to_mcore, convert_mcore_to_hf
from tools.convert_hf.verify import prompts, transformers_logits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = hf_factory.COMMON["vocab_size"]


def _state(hf_dir) -> dict[str, torch.Tensor]:
    out = {}
    for path in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


@pytest.mark.parametrize("family,dtype,seq_cls", [(f, torch.float32, False)
                                                  for f in hf_factory.FAMILIES]
                         + [("llama31", torch.bfloat16, False), ("qwen2", torch.float32, True)])
def test_round_trip_is_bit_exact(root, family, dtype, seq_cls):
    name = f"{family}_{str(dtype)[6:]}_{'rm' if seq_cls else 'lm'}"
    src = hf_factory.save_tiny_model(family, str(root / name), seed=3, dtype=dtype,
                                     seq_cls=seq_cls)
    ckpt = convert_hf_to_mcore(src, str(root / f"{name}.mcore"), progress=False)
    back = convert_mcore_to_hf(ckpt, str(root / f"{name}.back"), progress=False,
                               max_shard_bytes=150_000)
    a, b = _state(src), _state(back)
    if hf_factory.make_config(family).tie_word_embeddings:
        a.pop("lm_head.weight", None)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert len(glob.glob(os.path.join(back, "*.safetensors"))) > 1  # sharded by max_shard_bytes
    with open(os.path.join(back, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"]) == set(b)
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(back, extra)), extra


def test_export_loads_in_transformers_with_identical_logits(root):
    src = hf_factory.save_tiny_model("qwen3", str(root / "q3"), seed=5)
    ckpt = convert_hf_to_mcore(src, str(root / "q3.mcore"), progress=False)
    # Without the stored copy of the HF files, --hf-template supplies config and tokenizer.
    back = convert_mcore_to_hf(ckpt, str(root / "q3.back"), hf_template=src, progress=False)
    tokens = prompts(VOCAB)
    assert torch.equal(transformers_logits(back, tokens), transformers_logits(src, tokens))
    import transformers

    assert transformers.AutoTokenizer.from_pretrained(back)("w5 w7")["input_ids"] == [5, 7]


def test_dtype_cast_to_bf16(root):
    src = hf_factory.save_tiny_model("llama2", str(root / "l2"), seed=6)
    ckpt = convert_hf_to_mcore(src, str(root / "l2.bf16"), dtype="bf16", progress=False)
    back = convert_mcore_to_hf(ckpt, str(root / "l2.bf16.back"), progress=False)
    a, b = _state(src), _state(back)
    assert all(torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)
    with open(os.path.join(back, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"


@pytest.mark.parametrize("family", ["qwen2", "llama31"])
def test_dist_checkpoint_loads_at_tp2_and_pp2(root, family):
    src = hf_factory.save_tiny_model(family, str(root / f"{family}_tp"), seed=8)
    ckpt = convert_hf_to_mcore(src, str(root / f"{family}_tp.mcore"), progress=False)
    tokens = prompts(VOCAB, seq_len=10)
    ref = transformers_logits(src, tokens)
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        results = run_on_ranks(parity_bodies.logits_body, tp * pp,
                               args=(src, "ckpt", tp, pp, "actor", tokens, ckpt), timeout=240)
        ours = [r["out"] for r in results if r["out"] is not None][0][..., :VOCAB]
        assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4, (tp, pp)


def test_refuses_to_overwrite_and_never_leaves_a_partial_output(root):
    src = hf_factory.save_tiny_model("mistral", str(root / "m"), seed=9)
    out = str(root / "m.mcore")
    convert_hf_to_mcore(src, out, progress=False)
    with pytest.raises(FileExistsError, match="--force"):
        convert_hf_to_mcore(src, out, progress=False)
    convert_hf_to_mcore(src, out, progress=False, force=True)
    # A source missing a shard fails mid-way: no output directory, no temporary left behind.
    broken = str(root / "m_broken")
    hf_factory.save_tiny_model("mistral", broken, seed=9)
    os.remove(sorted(glob.glob(os.path.join(broken, "*.safetensors")))[-1])
    target = str(root / "m_broken.mcore")
    with pytest.raises(Exception):
        convert_hf_to_mcore(broken, target, progress=False)
    assert not any(p.startswith("m_broken.mcore") for p in os.listdir(root))


def test_converted_checkpoint_has_a_manifest_checked_before_any_read(root):
    from verl_mcore.utils.manifest import list_files, read_manifest
    from verl_mcore.utils.safe_read import BadCheckpointError

    src = hf_factory.save_tiny_model("qwen2", str(root / "q2_manifest"), seed=6)
    ckpt = convert_hf_to_mcore(src, str(root / "q2_manifest.mcore"), progress=False)
    files = read_manifest(ckpt)
    assert sorted(files) == list_files(ckpt) and "hf_config/config.json" in files
    [distcp] = glob.glob(os.path.join(ckpt, "*.distcp"))
    with open(distcp, "r+b") as f:  # one byte changed: the export is refused, nothing written
        f.seek(os.path.getsize(distcp) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    out = str(root / "q2_manifest.back")
    with pytest.raises(BadCheckpointError, match=r"\.distcp: SHA-256 .*contents changed"):
        convert_mcore_to_hf(ckpt, out, progress=False)
    assert not os.path.exists(out)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.convert_hf", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_cli_convert_and_verify_exit_codes(root, capsys):
    from tools.convert_hf.__main__ import main

    src = hf_factory.save_tiny_model("qwen2", str(root / "cli_src"), seed=10)
    other = hf_factory.save_tiny_model("qwen2", str(root / "cli_other"), seed=11)
    ckpt = str(root / "cli.mcore")
    run = _cli("hf-to-mcore", "--hf", src, "--out", ckpt, "--dtype", "fp32")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "hf-to-mcore" in run.stderr  # the progress bar
    run = _cli("verify", "--hf", src, "--ckpt", ckpt, "--tp", "2")
    assert run.returncode == 0 and "-> OK" in run.stdout, run.stdout + run.stderr[-3000:]
    # Different weights under the same architecture: above tolerance, exit code 1.
    assert main(["verify", "--hf", other, "--ckpt", ckpt]) == 1
    assert "-> FAILED" in capsys.readouterr().out


def test_hf_dir_writer_shards_a_stream_and_commits_atomically(root):
    """HFDirWriter (Policy.save_pretrained's writer): a stream of buckets becomes shards of at
    most max_shard_bytes with their index; an aborted write leaves no directory behind."""
    from transformers import AutoModelForCausalLM

    from verl_mcore.convert_hf.convert import HFDirWriter

    src = hf_factory.save_tiny_model("qwen2", str(root / "w_src"), seed=4)
    state = _state(src)
    names = sorted(state)
    writer = HFDirWriter(str(root / "w_out"), src, max_shard_bytes=40_000)
    for start in range(0, len(names), 3):  # buckets of three tensors, as a stream gives them
        writer.add([(n, state[n]) for n in names[start:start + 3]])
    out = writer.commit()
    shards = sorted(glob.glob(os.path.join(out, "model-*.safetensors")))
    assert len(shards) > 1 and all(os.path.getsize(s) < 40_000 + 4096 for s in shards
                                   if len(load_file(s)) > 1)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        assert sorted(json.load(f)["weight_map"]) == names
    back = _state(out)
    assert all(torch.equal(back[n], state[n]) for n in names)
    assert AutoModelForCausalLM.from_pretrained(out) is not None  # config and tokenizer copied
    aborted = HFDirWriter(str(root / "w_gone"), src)
    aborted.add([(names[0], state[names[0]])])
    aborted.abort()
    assert not os.path.exists(root / "w_gone") and not glob.glob(str(root / "w_gone*"))
    with pytest.raises(FileExistsError):
        HFDirWriter(out, src)


# --------------------------------------------------------------------------------------------
# Inputs the commands refuse before writing anything

@pytest.fixture(scope="module")
def llama(root):
    """(HF directory, its hf-to-mcore checkpoint) of an untied 4-layer Llama, vocab 250 padded
    to 256, made once for the checks below."""
    src = hf_factory.save_tiny_model("llama2", str(root / "checks"), seed=12)
    return src, convert_hf_to_mcore(src, str(root / "checks.mcore"), progress=False)


def _tree(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path)
                  for d, _, files in os.walk(path) for f in files)


def test_out_that_is_contains_or_lies_inside_an_input_is_refused(llama, tmp_path):
    """--out equal to, above or inside --hf / --ckpt / the template, also through a symlink or
    a relative path: refused naming both paths and the flag, the inputs untouched, --force or
    not (it used to delete --hf, or make the checkpoint's manifest refuse it)."""
    from verl_mcore.config import ConfigError
    from verl_mcore.convert_hf.convert import HFDirWriter

    src, ckpt = llama
    before = {p: _tree(p) for p in (src, ckpt)}
    link = str(tmp_path / "link")
    os.symlink(src, link)
    parent, name = os.path.split(src)
    refused = [
        ("is --hf", lambda: convert_hf_to_mcore(src, src, force=True)),
        ("contains --hf", lambda: convert_hf_to_mcore(src, parent, force=True)),
        ("lies inside --hf", lambda: convert_hf_to_mcore(src, os.path.join(src, "mcore"))),
        ("is --hf", lambda: convert_hf_to_mcore(link, src, force=True)),
        ("lies inside --ckpt", lambda: convert_mcore_to_hf(ckpt, os.path.join(ckpt, "hf"))),
        ("contains --ckpt", lambda: convert_mcore_to_hf(ckpt, parent, force=True)),
        ("lies inside --hf-template", lambda: convert_mcore_to_hf(
            ckpt, os.path.join(src, "hf"), hf_template=src)),
        ("lies inside model.path", lambda: HFDirWriter(os.path.join(src, "x"), src,
                                                       inputs={"model.path": src})),
    ]
    cwd = os.getcwd()
    os.chdir(parent)
    try:  # a relative --out naming the input
        with pytest.raises(ConfigError, match=r"--out checks is --hf .*\(resolved: "):
            convert_hf_to_mcore(src, name, force=True, progress=False)
    finally:
        os.chdir(cwd)
    for how, call in refused:
        with pytest.raises(ConfigError, match=f"--out .* {how} .*choose an --out outside"):
            call()
    assert {p: _tree(p) for p in (src, ckpt)} == before
    assert not glob.glob(os.path.join(parent, "*.tmp-*"))


def test_cli_refuses_an_out_inside_a_step_directory(llama, tmp_path, capsys):
    """A trainer step directory (meta.json + dist/): --out inside it is refused whether --ckpt
    names the step or its dist/ (the export used to land in the step, and the next resume moved
    the run's checkpoint aside as corrupt)."""
    from tools.convert_hf.__main__ import main

    src, ckpt = llama
    step = tmp_path / "step_00000001"
    shutil.copytree(ckpt, step / "dist")
    (step / "meta.json").write_text(json.dumps({"format": 1, "step": 1}))
    for given in (step, step / "dist"):
        assert main(["mcore-to-hf", "--ckpt", str(given), "--out", str(step / "hf"),
                     "--hf-template", src, "--quiet"]) == 2
        assert f"--out {step / 'hf'} lies inside --ckpt {step}:" in capsys.readouterr().err
    assert sorted(os.listdir(step)) == ["dist", "meta.json"]
    assert main(["hf-to-mcore", "--hf", src, "--out", src, "--force", "--quiet"]) == 2
    assert f"--out {src} is --hf {src}" in capsys.readouterr().err


def _template(src, dst, **edits) -> str:
    """A copy of src's non-weight files with config.json fields changed."""
    from verl_mcore.convert_hf.convert import copy_metadata_files

    copy_metadata_files(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(edits)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("edits,message", [
    ({"num_hidden_layers": 3}, "num_layers = 3 in the config, 4 in the checkpoint"),
    ({"num_hidden_layers": 5}, "num_layers = 5 in the config, 4 in the checkpoint"),
    ({"vocab_size": 200}, "vocab_size = 200 in the config, 250 in the checkpoint"),
    ({"tie_word_embeddings": True}, "tie_embeddings = True in the config, False in the checkpoint"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
     "rope.theta = 1000000.0 in the config, 10000.0 in the checkpoint"),
    ({"num_attention_heads": 2, "head_dim": 32}, "num_heads = 2 in the config, 4 in the"),
])
def test_template_of_another_architecture_is_refused(llama, tmp_path, edits, message):
    """--hf-template against the config.json hf-to-mcore stored: every field compared (these
    used to export silently: layers dropped, the embedding cut, the LM head dropped, another
    RoPE or head split written)."""
    from verl_mcore.config import ConfigError

    src, ckpt = llama
    template = _template(src, str(tmp_path / "template"), **edits)
    out = str(tmp_path / "out")
    with pytest.raises(ConfigError, match=rf"{template}/config.json does not describe the "
                                          rf"checkpoint .*hf_config/config.json.*{message}"):
        convert_mcore_to_hf(ckpt, out, hf_template=template, progress=False)
    assert not os.path.exists(out)


def test_without_a_record_the_stored_tensors_are_checked(llama, tmp_path):
    """A checkpoint without its stored config: the template is checked against the tensors
    (stacked layer count, vocabulary rows exactly the padded size, no tensor left unread);
    a matching template exports bit-exact."""
    from verl_mcore.config import ConfigError
    from verl_mcore.utils.manifest import MANIFEST, build_manifest

    src, ckpt = llama
    bare = str(tmp_path / "bare.mcore")
    shutil.copytree(ckpt, bare)
    shutil.rmtree(os.path.join(bare, "hf_config"))
    os.remove(os.path.join(bare, MANIFEST))
    with open(os.path.join(bare, MANIFEST), "w") as f:
        json.dump(build_manifest(bare), f)
    cases = {
        "layers": ({"num_hidden_layers": 3}, r"num_hidden_layers = 3, but the checkpoint .* "
                                             r"holds 4 layers"),
        "vocab": ({"vocab_size": 120}, r"vocab_size = 120 \(padded to 128 rows\), but "
                                       r"embedding.word_embeddings.weight .* has 256 rows"),
        "tied": ({"tie_word_embeddings": True}, r"no place for \['output_layer.weight'\] "
                                                r"\(tie_word_embeddings = true"),
    }
    for name, (edits, message) in cases.items():
        template = _template(src, str(tmp_path / name), **edits)
        with pytest.raises(ConfigError, match=message):
            convert_mcore_to_hf(bare, str(tmp_path / "out"), hf_template=template,
                                progress=False)
    back = convert_mcore_to_hf(bare, str(tmp_path / "out"), hf_template=src, progress=False)
    a, b = _state(src), _state(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_sliding_window_checkpoint_verifies_and_exports_back(root):
    """A Mistral with sliding_window converted with --max-seq-len: verify (its prompts are
    shorter than the window) and mcore-to-hf (the bound is recorded in the checkpoint) work, and
    the exported config.json is the original's, byte for byte."""
    from tools.convert_hf.verify import verify

    src = hf_factory.save_tiny_model("mistral", str(root / "sw"), seed=13, sliding_window=64)
    ckpt = convert_hf_to_mcore(src, str(root / "sw.mcore"), max_seq_len=64, progress=False)
    assert verify(src, ckpt)["max_abs"] <= 1e-4
    for template in (None, src):
        back = convert_mcore_to_hf(ckpt, str(root / f"sw.back{template is None}"),
                                   hf_template=template, progress=False)
        with open(os.path.join(src, "config.json"), "rb") as a, \
                open(os.path.join(back, "config.json"), "rb") as b:
            assert a.read() == b.read()
        assert all(torch.equal(_state(src)[k], v) for k, v in _state(back).items())
