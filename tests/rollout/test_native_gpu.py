"""The native engine as it runs on a GPU (CUDA graphs of the whole decode step, fused kernels,
the Triton paged kernel, torch's flash kernel, the csrc/ paged kernel, 256-token blocks): its
tokens and log-probs against transformers' forward over the same sequences. The body runs in its own process
(tests/rollout/native_gpu_body.py)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


CHOICE = {"default": "", "flash": "flash", "paged_kernel": "kernel"}


@pytest.fixture(scope="module", params=list(CHOICE))
def res(request):
    """The body as the engine picks its attention (the Triton paged kernel where Triton is
    installed: the GPU image has it), with torch's flash kernel, and with the csrc/ paged kernel
    (VERL_MCORE_PAGED_KERNEL=flash / kernel)."""
    body = os.path.join(os.path.dirname(__file__), "native_gpu_body.py")
    env = dict(os.environ, VERL_MCORE_PAGED_KERNEL=CHOICE[request.param])
    out = subprocess.run([sys.executable, body], capture_output=True, text=True, timeout=600, env=env)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and line, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])


def test_gpu_path_is_the_fast_one(res, request):
    # Triton's paged kernel by default; torch's flash kernel paged where it takes a block table,
    # else one 256-multiple block a sequence; the csrc/ paged kernel when asked for
    modes = {"default": ("triton",), "flash": ("paged", "sequence"), "paged_kernel": ("kernel",)}
    assert res["fused"] and res["attention"] in modes[request.node.callspec.params["res"]]
    assert res["block_size"] == (768 if res["attention"] == "sequence" else 256)  # 511 + 40 tokens


@pytest.mark.parametrize("tag", ["greedy", "sampled", "greedy_tight", "sampled_eager", "sampled_compact"])
def test_tokens_and_logprobs_match_transformers(res, tag):
    r = res[tag]
    # bf16: the engine's log-probs within bf16 rounding of transformers' on the same sequence
    assert r["logprob_diff_max"] < 0.05, r["logprob_diff_max"]
    if tag.startswith("greedy"):
        # greedy picks transformers' best token up to bf16 near-ties
        assert r["greedy_margin_max"] < 0.05, r["greedy_margin_max"]


def test_every_call_decodes_in_cuda_graphs(res):
    # a capture that fails falls back to eager steps with a warning only: stop ids once did (the
    # stop check's torch.isin synced), and with them the graph's split count changed between calls
    assert {tag: res[tag]["stats"]["rollout/cuda_graphs"] for tag in ("greedy", "sampled", "sampled_again",
            "greedy_tight", "sampled_eager", "sampled_compact")} == dict(
        greedy=1, sampled=1, sampled_again=1, greedy_tight=1, sampled_eager=0, sampled_compact=1)
    assert res["sampled_compact"]["stats"]["rollout/compactions"] > 0


def test_sampling_on_device_is_seeded_and_stops(res):
    assert res["sampled"]["tokens"] == res["sampled_again"]["tokens"]
    tokens = res["sampled"]["tokens"]
    stopped = [t for t in tokens if len(t) < 40]
    assert stopped and all(t[-1] < 50 for t in stopped)  # ended by a stop id (0..49) ...
    assert all(t >= 50 for ts in tokens for t in ts[:-1])  # ... at its first one


def test_prefix_sharing_and_preemption_on_gpu(res):
    st, tight = res["greedy"]["stats"], res["greedy_tight"]["stats"]
    assert tight["rollout/kv_blocks"] == 6
    if res["attention"] in ("paged", "kernel", "triton"):
        # prompts of 256, 257, 300 and 511 tokens have one full block; their second samples share it
        assert st["rollout/kv_shared_prefix_blocks"] == 4
        assert tight["rollout/preemptions"] > 0
    else:  # whole-sequence blocks: nothing to share, six sequences at a time
        assert st["rollout/kv_shared_prefix_blocks"] == 0
        assert tight["rollout/peak_live_sequences"] == 6
