"""tools.convert_hf on a real pretrained model (SmolLM2-135M-Instruct: bf16, tied embeddings,
9 query / 3 KV heads, rope theta 1e5): hf -> mcore -> hf is bit-exact, and `verify` reports
megatron's logits within fp32 rounding of transformers' at TP = 3 (the TP above 1 that divides 9
heads / 3 KV heads; at TP = 1 the logits came out bit-identical when this was written, so TP = 3,
whose partial sums add up in another order, is the informative layout)."""
import glob
import json
import os
import re

from safetensors.torch import load_file

from tools.convert_hf.__main__ import main


def _state(hf_dir):
    out = {}
    for path in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        out.update(load_file(path))
    return out


def test_round_trip_is_bit_exact_and_verify_is_within_fp32_rounding(smollm2, tmp_path, capsys):
    ckpt, back = str(tmp_path / "smol.mcore"), str(tmp_path / "smol.back")
    assert main(["hf-to-mcore", "--hf", smollm2, "--out", ckpt, "--quiet"]) == 0
    assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", back, "--quiet"]) == 0
    a, b = _state(smollm2), _state(back)
    assert sorted(a) == sorted(b) and "lm_head.weight" not in b  # tied: the embedding only
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].equal(b[key]), key
    with open(os.path.join(back, "config.json")) as f:
        config = json.load(f)
    assert config["tie_word_embeddings"] and config["rope_parameters"]["rope_theta"] == 1e5
    capsys.readouterr()
    assert main(["verify", "--hf", smollm2, "--ckpt", ckpt, "--tp", "3"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"verify tp=3 pp=1 ep=1: max_abs=(\S+) max_rel=(\S+) tolerance=\S+ -> OK", line)
    assert m, line
    max_abs, max_rel = float(m[1]), float(m[2])
    # fp32 on both sides from the same bf16 weights: only the order of float operations differs
    # (2.1e-6 relative when this was written; the command's own tolerance is 1e-4).
    print(f"real-model verify: max_abs={max_abs:.3e} max_rel={max_rel:.3e}")
    assert max_rel < 1e-5, line
