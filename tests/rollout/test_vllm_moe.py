"""The vLLM engine's weight stream for mixture-of-experts models, up to vLLM's boundary: every
expert, router, shared expert and gate goes out under its Hugging Face name, equal to the
checkpoint's tensor (vLLM itself runs only on a GPU with vllm installed)."""
import pytest

from tests.models import hf_factory
from tests.multiproc import run_on_ranks
from tests.rollout.test_vllm_engine import _stream_body


@pytest.mark.distributed
@pytest.mark.parametrize("family, tp_gen", [("qwen2_moe", 2), ("qwen3_moe", 1), ("mixtral", 2)])
def test_moe_hf_stream_reproduces_checkpoint(tmp_path, family, tp_gen):
    hf_dir = hf_factory.save_tiny_model(family, str(tmp_path / family), seed=5)
    results = run_on_ranks(_stream_body, tp_gen, args=(hf_dir, tp_gen, 40_000, tp_gen, 128),
                           timeout=180)
    for rank, r in enumerate(results):
        assert r["mismatched"] == [], (rank, r["mismatched"][:5])
        assert sorted(r["seen"]) == sorted(r["names"]), rank  # every HF tensor exactly once
        assert any(".experts." in n for n in r["seen"])
