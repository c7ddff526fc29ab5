"""mcore-to-hf of a LoRA actor checkpoint (convert_hf/lora_export.py): the peft adapter directory
loads in peft with our megatron model's logits, --merge gives a transformers model with the same
logits, the directory starts a model again (lora.init_from's path), and bad inputs are named.

The checkpoints are saved as the trainer saves them (engine.checkpoint.Checkpointer: adapters
only, meta.json recording the base, the run's config.yaml) from random non-zero adapters
(init_lora_weights=False) at TP=2 and at PP=2. fp32 throughout, logits within 1e-5 relative."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file

from tests.models import hf_factory
from tests.models.lora_bodies import lora_checkpoint_body, lora_from_peft_body
from tests.multiproc import run_on_ranks
from verl_mcore.config import ConfigError
from verl_mcore.convert_hf.__main__ import main
from verl_mcore.convert_hf.convert import convert_hf_to_mcore
from verl_mcore.convert_hf.lora_export import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    export_merged,
    export_peft,
    open_checkpoint,
)
from verl_mcore.convert_hf.verify import prompts, transformers_logits
from verl_mcore.utils.safe_read import BadCheckpointError
from verl_mcore.models import lora
from verl_mcore.models.hf_config import read_hf_arch

TOL = 1e-5
SEED = 11
VOCAB = hf_factory.COMMON["vocab_size"]
TOKENS = prompts(VOCAB, batch=2, seq_len=12)
SAVES = {  # name: (tp, pp, target_modules)
    "tp2_all_linear": (2, 1, "all-linear"),
    "pp2_q_v": (1, 2, ["q_proj", "v_proj"]),
    "tp2_with_head": (2, 1, ["all-linear", "lm_head"]),  # on an untied model (an lm_head of its own)
}


class Saved(NamedTuple):
    path: str  # RUN/checkpoints/actor/step_00000001
    targets: object
    logits: torch.Tensor  # our megatron LoRA model's [b, s, V]
    base: str  # the HF model it adapts


def _modules(arch, targets):
    """(layer, target) of every adapted module, lm_head's layer None (LoRACheckpoint.modules)."""
    names = lora.resolve_targets(targets)
    layers = [(layer, t) for layer in range(arch.num_layers) for t in names if t != lora.HEAD]
    return layers + ([(None, lora.HEAD)] if lora.HEAD in names else [])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("convert_lora")


@pytest.fixture(scope="module")
def hf_dir(root):
    return hf_factory.save_tiny_model("qwen2", str(root / "qwen2"), seed=3)


@pytest.fixture(scope="module")
def saved(root, hf_dir):
    """saved(name): the checkpoint of SAVES[name], saved once per module."""
    done = {}

    def get(name):
        if name not in done:
            tp, pp, targets = SAVES[name]
            base = hf_dir
            if lora.HEAD in targets:
                base = hf_factory.save_tiny_model("qwen2_untied", str(root / "untied"), seed=3)
            results = run_on_ranks(lora_checkpoint_body, tp * pp, timeout=300,
                                   args=(base, tp, pp, targets, TOKENS, SEED,
                                         str(root / name / "checkpoints" / "actor")))
            [logits] = [r["logits"] for r in results if r["logits"] is not None]
            done[name] = Saved(results[0]["path"], targets, logits[..., :VOCAB], base)
        return done[name]

    return get


def _rel(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def _peft_logits(hf_dir, adapter_dir):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def _state(hf_dir) -> dict[str, torch.Tensor]:
    out = {}
    for path in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.mark.parametrize("case", SAVES)
def test_adapter_directory_loads_in_peft_with_our_logits(case, saved, tmp_path, capsys):
    ck = saved(case)
    hf_dir = ck.base
    out = str(tmp_path / "adapter")
    assert main(["mcore-to-hf", "--ckpt", ck.path, "--out", out]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    with open(os.path.join(out, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    targets = list(lora.resolve_targets(ck.targets))
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, targets)
    assert config["base_model_name_or_path"] == hf_dir  # the base meta.json records
    # peft's names, full tensors gathered from the shards: the values the model started from
    tensors = load_file(os.path.join(out, ADAPTER_WEIGHTS))
    arch = read_hf_arch(hf_dir)
    modules = _modules(arch, ck.targets)
    assert sorted(tensors) == sorted(lora.peft_key(layer, t, w) for layer, t in modules
                                     for w in ("A", "B"))
    for layer, t in modules:  # lm_head's B: the HF vocabulary's rows, the padding cut
        a, b = lora.initial_values(arch, 4, False, SEED, layer, t)
        assert torch.equal(tensors[lora.peft_key(layer, t, "A")], a)
        assert torch.equal(tensors[lora.peft_key(layer, t, "B")], b)
    assert _rel(_peft_logits(hf_dir, out), ck.logits) <= TOL


@pytest.mark.parametrize("case", SAVES)
def test_merged_model_has_peft_logits_in_transformers(case, saved, tmp_path):
    ck = saved(case)
    hf_dir = ck.base
    adapter = str(tmp_path / "adapter")
    merged = str(tmp_path / "merged")
    _, checkpoint = open_checkpoint(ck.path)
    export_peft(checkpoint, adapter)
    # its dist/ names the same checkpoint; small shards exercise the index
    assert main(["mcore-to-hf", "--ckpt", os.path.join(ck.path, "dist"), "--out", merged,
                 "--merge", "--quiet", "--max-shard-size", "100KB"]) == 0
    logits = transformers_logits(merged, TOKENS)
    assert _rel(logits, _peft_logits(hf_dir, adapter)) <= TOL
    assert _rel(logits, ck.logits) <= TOL
    assert len(glob.glob(os.path.join(merged, "model-*.safetensors"))) > 1
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(merged, name)), name
    # targeted weights are W + (alpha / r)·B·A, everything else is the base's to the bit
    base, ours = _state(hf_dir), _state(merged)
    assert sorted(base) == sorted(ours)
    targeted = {f"{lora.hf_module(layer, t)}.weight": (layer, t) for layer, t in checkpoint.modules()}
    assert ("lm_head.weight" in targeted) == (lora.HEAD in checkpoint.targets)
    for name, weight in base.items():
        if name in targeted:
            a, b = lora.initial_values(read_hf_arch(hf_dir), 4, False, SEED, *targeted[name])
            assert torch.allclose(ours[name], weight + 2.0 * b @ a, rtol=0, atol=1e-6), name
        else:
            assert torch.equal(ours[name], weight), name


def test_merge_into_a_dist_checkpoint_base_equals_the_hf_base(saved, hf_dir, tmp_path):
    ck = saved("pp2_q_v")
    base = convert_hf_to_mcore(hf_dir, str(tmp_path / "base.mcore"), progress=False)
    _, checkpoint = open_checkpoint(ck.path)
    from_hf = _state(export_merged(checkpoint, str(tmp_path / "from_hf"), progress=False))
    from_dist = _state(export_merged(checkpoint, str(tmp_path / "from_dist"), base=base,
                                     progress=False))
    from_hf.pop("lm_head.weight", None)  # tied: the dist checkpoint's export has none
    assert sorted(from_hf) == sorted(from_dist)
    assert all(torch.equal(from_hf[k], from_dist[k]) for k in from_hf)


@pytest.mark.parametrize("case", ["tp2_all_linear", "tp2_with_head"])
def test_adapter_directory_starts_a_model_at_another_layout(case, saved, tmp_path):
    """Saved at TP=2, exported, loaded at PP=2 through attach_lora + load_peft_dir (what
    actor.lora.init_from does): the same adapter tensors in every shard (lm_head's B padded
    back with zero rows), the same logits."""
    ck = saved(case)
    _, checkpoint = open_checkpoint(ck.path)
    adapter = export_peft(checkpoint, str(tmp_path / "adapter"))
    tensors = load_file(os.path.join(adapter, ADAPTER_WEIGHTS))
    results = run_on_ranks(lora_from_peft_body, 2, timeout=300,
                           args=(ck.base, 1, 2, ck.targets, TOKENS, adapter))
    [logits] = [r["logits"] for r in results if r["logits"] is not None]
    assert _rel(logits[..., :VOCAB], ck.logits) <= TOL
    layers = set()
    for r in results:
        for (layer, t, which), shard in r["shards"].items():
            full = tensors[lora.peft_key(layer, t, which)]
            if t == lora.HEAD and which == "B":  # [V_padded, r]: the real rows, then zeros
                assert torch.equal(shard[:VOCAB], full) and not shard[VOCAB:].any()
                assert shard.shape[0] > VOCAB
            else:
                assert torch.equal(shard, lora.tp_slice(full, lora.tp_shard_dim(t, which), 0, 1))
            layers.add(layer)
    expected = set(range(read_hf_arch(ck.base).num_layers))
    assert layers == expected | ({None} if lora.HEAD in ck.targets else set())


@pytest.fixture(scope="module")
def full_step(root, hf_dir):
    """The step directory of a fully trained (no LoRA) model, saved as the trainer saves it."""
    results = run_on_ranks(lora_checkpoint_body, 2, timeout=300,
                           args=(hf_dir, 2, 1, None, TOKENS, SEED, str(root / "full_run")))
    return results[0]["path"]


@pytest.mark.parametrize("template", [True, False])
def test_a_fully_trained_step_directory_exports_as_before(full_step, hf_dir, tmp_path, template):
    """No LoRA: --ckpt a step directory (its dist/ read as hf-to-mcore's) saved without a copy of
    the HF files (as the trainer saved before it kept one in dist/hf_config/, and as
    lora_checkpoint_body saves): the config and tokenizer come from --hf-template, or without it
    from the model.path its config.yaml records. The weights come back to the bit."""
    out = str(tmp_path / "hf")
    flags = ["--hf-template", hf_dir] if template else []
    assert main(["mcore-to-hf", "--ckpt", full_step, "--out", out, *flags, "--quiet"]) == 0
    base, back = _state(hf_dir), _state(out)
    base.pop("lm_head.weight", None)  # tied
    assert sorted(base) == sorted(back) and all(torch.equal(base[k], back[k]) for k in base)


def test_a_missing_config_source_is_one_line_naming_the_file_and_the_flag(root, hf_dir, tmp_path,
                                                                           capsys):
    """A step directory without the HF files whose recorded model.path has moved, and an
    --hf-template without a config.json: exit 2, one line, no traceback, nothing written."""
    moved = str(tmp_path / "moved_model")
    shutil.copytree(hf_dir, moved)
    [result] = run_on_ranks(lora_checkpoint_body, 1, timeout=300,
                            args=(moved, 1, 1, None, TOKENS, SEED, str(tmp_path / "run")))
    shutil.rmtree(moved)
    out = str(tmp_path / "out")
    assert main(["mcore-to-hf", "--ckpt", result["path"], "--out", out, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err == (f"error: {result['path']}/dist/hf_config/config.json: not in the checkpoint, nor "
                   f"at model.path {moved} that {result['path']}/config.yaml records (moved or "
                   "deleted?); pass --hf-template DIR, an HF directory of the model the checkpoint "
                   "was trained or converted from\n")
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert main(["mcore-to-hf", "--ckpt", result["path"], "--out", out, "--hf-template", empty,
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --hf-template {empty}: no config.json there; pass an HF directory " \
                  "of the model the checkpoint was trained or converted from\n"
    assert not os.path.exists(out)


def test_bad_inputs_are_refused_naming_the_fix(saved, hf_dir, tmp_path, capsys):
    ck = saved("pp2_q_v")

    def fails(*args) -> str:
        assert main(["mcore-to-hf", *args]) == 2
        return capsys.readouterr().err

    # a dist directory away from its step directory: nothing says what the adapters are
    lonely = str(tmp_path / "lonely")
    shutil.copytree(os.path.join(ck.path, "dist"), lonely)
    err = fails("--ckpt", lonely, "--out", str(tmp_path / "x"))
    assert "meta.json" in err and "config.yaml" in err and "step directory" in err
    # --merge / --base on a checkpoint of full weights; without them it exports as before
    full = convert_hf_to_mcore(hf_dir, str(tmp_path / "full.mcore"), progress=False)
    assert "no LoRA adapters" in fails("--ckpt", full, "--out", str(tmp_path / "x"), "--merge")
    assert main(["mcore-to-hf", "--ckpt", full, "--out", str(tmp_path / "full_hf"),
                 "--quiet"]) == 0
    # a peft directory has no config or tokenizer to take from a template
    assert "--merge" in fails("--ckpt", ck.path, "--out", str(tmp_path / "x"),
                              "--hf-template", hf_dir)
    # the recorded base moved away: named, with the flag that gives another
    _, checkpoint = open_checkpoint(ck.path)
    moved = dataclasses.replace(checkpoint, base=str(tmp_path / "moved_away"))
    with pytest.raises(ConfigError, match=r"moved_away, which no longer exists; pass --base"):
        export_merged(moved, str(tmp_path / "x"))
    # a base of another shape
    small = hf_factory.save_tiny_model("qwen2", str(tmp_path / "small"), num_hidden_layers=2)
    assert "2 layers" in fails("--ckpt", ck.path, "--out", str(tmp_path / "x"), "--merge",
                               "--base", small)
    # the step directory's config.yaml changed after the save: refused before anything is read
    copy = str(tmp_path / "step_00000001")
    shutil.copytree(ck.path, copy)
    with open(os.path.join(copy, "config.yaml"), "a") as f:
        f.write("# edited\n")
    with pytest.raises(BadCheckpointError, match=r"config.yaml: changed since the save"):
        open_checkpoint(copy)
    assert not glob.glob(str(tmp_path / "x*"))


@pytest.mark.parametrize("edits,message", [
    ({"num_hidden_layers": 3}, "num_layers = 3 in the config, 4 in the checkpoint"),
    ({"tie_word_embeddings": False}, "tie_embeddings = False in the config, True in the"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
     "rope.theta = 500000.0 in the config, 10000.0 in the checkpoint"),
    ({"max_position_embeddings": 64}, "max_position_embeddings = 64 in the config, 256 in the"),
])
def test_step_directory_refuses_a_template_of_another_architecture(full_step, hf_dir, tmp_path,
                                                                   capsys, edits, message):
    """--hf-template against the step's model_arch.json, every field it records (a one-layer
    template used to drop layer 1, another rope_theta went into config.json silently)."""
    template = str(tmp_path / "template")
    shutil.copytree(hf_dir, template)
    with open(os.path.join(template, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(template, "config.json"), "w") as f:
        json.dump({**cfg, **edits}, f)
    out = str(tmp_path / "out")
    assert main(["mcore-to-hf", "--ckpt", full_step, "--out", out, "--hf-template", template,
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{template}/config.json does not describe" in err and "model_arch.json" in err, err
    assert message in err, err
    assert not os.path.exists(out)


def test_exports_refuse_an_out_over_or_inside_what_they_read(saved, full_step, hf_dir,
                                                             tmp_path, capsys):
    """--out inside the step directory (the next resume would find files its manifest does not
    list and move the run's checkpoint aside as corrupt) or over the base the adapters name
    (--force would delete it): refused, nothing changed."""
    from verl_mcore.utils import manifest

    ck = saved("pp2_q_v")
    before = {p: sorted(os.listdir(p)) for p in (ck.path, full_step, hf_dir)}

    def refused(*args) -> str:
        assert main(["mcore-to-hf", *args, "--quiet"]) == 2
        return capsys.readouterr().err

    assert f"lies inside --ckpt {ck.path}" in refused("--ckpt", ck.path, "--out",
                                                      os.path.join(ck.path, "adapter"))
    assert f"lies inside --ckpt {full_step}" in refused(
        "--ckpt", os.path.join(full_step, "dist"), "--out", os.path.join(full_step, "hf"),
        "--hf-template", hf_dir)
    assert f"is base_weights of {ck.path}/meta.json {hf_dir}" in refused(
        "--ckpt", ck.path, "--out", hf_dir, "--merge", "--force")
    base = str(tmp_path / "proj" / "base")
    shutil.copytree(hf_dir, base)
    assert f"contains --base {base}" in refused(
        "--ckpt", ck.path, "--out", str(tmp_path / "proj"), "--merge", "--base", base, "--force")
    assert os.listdir(base) == os.listdir(hf_dir)
    assert {p: sorted(os.listdir(p)) for p in before} == before
    for step in (ck.path, full_step):  # still passes the manifest check of a resume
        manifest.verify_share(step, manifest.read_manifest(step))
