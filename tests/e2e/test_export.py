"""A trained run's checkpoint becomes a Hugging Face model with `mcore-to-hf --ckpt STEP --out DIR`
and nothing else: each actor checkpoint carries the HF config and tokenizer files the run started
from (dist/hf_config/), so the export needs no --hf-template, even after the model directory is
gone. The exported model is the trained one: transformers' greedy output from it is the
trainer's own greedy validation output at that step."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# Three quickstart steps: the greedy answers have left the random model's and still differ from
# prompt to prompt (a few steps more and they collapse to one string for every prompt).
STEPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run directory, the step's checkpoint) of a quickstart run of STEPS steps that validated
    greedily and saved at its last step; the model directory it started from is deleted after."""
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("export")
    model = make_tiny_model(str(root / "model"))
    run_dir = root / "run"
    argv = [sys.executable, "-m", "verl_mcore.train", "--config", "configs/quickstart.yaml",
            f"model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.total_steps={STEPS}",
            f"trainer.val_every={STEPS}", "trainer.log_val_generations=100",
            f"checkpoint.save_every={STEPS}", "reward.num_workers=0"]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    shutil.rmtree(model)  # moved or deleted since: the checkpoint must not need it
    return run_dir, run_dir / "checkpoints" / "actor" / f"step_{STEPS:08d}"


def _greedy(model, tokenizer, prompt: str, max_new: int) -> str:
    """transformers' greedy continuation of `prompt` (the trainer's decoded prompt), decoded as
    the trainer decodes responses (special tokens left out)."""
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_export_needs_only_ckpt_and_out_and_gives_the_trainers_greedy_output(trained, tmp_path,
                                                                              capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.make_tiny_model import make_tiny_model
    from verl_mcore.config import Config
    from verl_mcore.convert_hf.__main__ import main

    run_dir, step = trained
    out = tmp_path / "hf"
    assert main(["mcore-to-hf", "--ckpt", str(step), "--out", str(out), "--quiet"]) == 0, \
        capsys.readouterr().err
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    max_new = Config.load(str(step / "config.yaml")).data.max_response_length
    rows = [json.loads(line) for line in
            (run_dir / "val_generations" / f"step_{STEPS}.jsonl").read_text().splitlines()]
    assert len(rows) >= 8
    ours = [_greedy(model, tokenizer, row["prompt"], max_new) for row in rows]
    assert ours == [row["response"] for row in rows]
    # The trained weights, not the initial ones: the model the run started from (the same seed,
    # made again) answers otherwise.
    initial = AutoModelForCausalLM.from_pretrained(make_tiny_model(str(tmp_path / "initial")),
                                                   dtype=torch.float32).eval()
    assert _greedy(initial, tokenizer, rows[0]["prompt"], max_new) != ours[0]


@pytest.mark.slow
def test_the_checkpoint_carries_the_runs_hf_files(trained):
    _, step = trained
    stored = step / "dist" / "hf_config"
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} <= set(os.listdir(stored))
    assert not [n for n in os.listdir(stored) if n.endswith(".safetensors")]
    # Listed in the checkpoint's manifest: a changed copy is caught like any other file.
    manifest = json.loads((step / "manifest.json").read_text())["files"]
    assert "dist/hf_config/config.json" in manifest and "dist/hf_config/tokenizer.json" in manifest
