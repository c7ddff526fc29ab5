"""Conversion streams: peak host RSS stays near twice the largest tensor plus a fixed overhead.

A ~360 MB fp32 Llama-shaped checkpoint (largest tensor: the 32 MiB embedding / LM head) is
converted HF -> mcore -> HF in a subprocess. The subprocess first converts a tiny model (so every
module the conversion imports is loaded: that is the fixed overhead), then resets the kernel's
peak-RSS mark (/proc/self/clear_refs, "5") and converts the big one. The growth of the peak over
the RSS at the reset must stay within 2x the largest tensor plus a fixed allowance, far below
the model size.

Measured on the CPU machine (2026-12-02), 3-layer models with the embedding as largest tensor:
HF -> mcore grew 100 / 165 / 293 MiB for a 32 / 64 / 128 MiB embedding, i.e. ~2x the largest
tensor plus ~35 MiB (one layer's intermediates: QKV fusion, the writer holding the previous
chunk); mcore -> HF grew 0 / 63 / 256 MiB.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from tests.models import hf_factory

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1024**2

_RUN = """
import re, sys
from tools.convert_hf.convert import convert_hf_to_mcore, convert_mcore_to_hf

def status_kb(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

def both_ways(src, work):
    convert_hf_to_mcore(src, work + "/mcore", progress=False)
    convert_mcore_to_hf(work + "/mcore", work + "/back", progress=False,
                        max_shard_bytes=100 << 20)

tiny, big, work = sys.argv[1:4]
both_ways(tiny, work + "/tiny")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
before = status_kb("VmRSS")
both_ways(big, work + "/big")
print("RSS_KB", before, status_kb("VmHWM"))
"""


def _write_random_llama(out_dir: str, hidden: int, ffn: int, layers: int, heads: int,
                        kv_heads: int, vocab: int) -> tuple[int, int]:
    """A random fp32 Llama checkpoint, one shard per layer; returns (total, largest) bytes."""
    config = hf_factory.make_config("llama2", hidden_size=hidden, intermediate_size=ffn,
                                    num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=kv_heads, vocab_size=vocab)
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    g = torch.Generator().manual_seed(0)
    hd = hidden // heads
    shards = {"model-embed.safetensors": {"model.embed_tokens.weight": (vocab, hidden),
                                          "lm_head.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,)}}
    for i in range(layers):
        p = f"model.layers.{i}."
        shards[f"model-layer{i}.safetensors"] = {
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * hd, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn)}
    weight_map, total, largest = {}, 0, 0
    for fname, shapes in shards.items():
        tensors = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.numel() * 4
            largest = max(largest, t.numel() * 4)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total, largest


def _rss_before_and_peak(tiny: str, big: str, work: str) -> tuple[int, int]:
    run = subprocess.run([sys.executable, "-c", _RUN, tiny, big, work], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RSS_KB")][-1]
    before, peak = (int(x) * 1024 for x in line.split()[1:])
    return before, peak


@pytest.mark.slow
def test_peak_rss_is_about_twice_the_largest_tensor(tmp_path):
    _write_random_llama(str(tmp_path / "tiny"), 64, 128, 2, 4, 2, 256)
    total, largest = _write_random_llama(str(tmp_path / "big"), hidden=1024, ffn=4096, layers=5,
                                         heads=16, kv_heads=4, vocab=8192)
    assert total > 300 * MiB and largest == 32 * MiB
    before, peak = _rss_before_and_peak(str(tmp_path / "tiny"), str(tmp_path / "big"),
                                        str(tmp_path / "work"))
    extra = peak - before
    print(f"model {total / MiB:.0f} MiB, largest tensor {largest / MiB:.0f} MiB, "
          f"RSS before {before / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB, "
          f"growth {extra / MiB:.0f} MiB")
    assert extra <= 2 * largest + 64 * MiB, extra / MiB
    assert extra < total / 3  # nowhere near holding the model
