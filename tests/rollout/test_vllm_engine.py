"""The vLLM engine up to the vLLM call: HF tensor stream, sampling translation, output conversion;
and end to end where `import vllm` works (GPU)."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.multiproc import run_on_ranks
from verl_mcore.rollout.base import SamplingParams
from verl_mcore.rollout.vllm_engine import from_vllm_outputs, to_vllm_sampling, vllm_available


def _stream_body(rank, world_size, hf_dir, tp_gen, bucket_bytes, tp_train, divisible_by):
    from tests.rollout import engine_bodies as eb
    from verl_mcore.models.hf_weights import HFCheckpoint
    from verl_mcore.rollout.vllm_engine import hf_weight_stream

    groups = eb.setup(tp_gen, tp_gen)
    arch, model = eb.generation_model(hf_dir, groups, tp_gen, tp_train, divisible_by=divisible_by)
    ckpt = HFCheckpoint(hf_dir)
    seen, mismatched, buckets = [], [], []
    for bucket in hf_weight_stream(model, arch, groups.gen_tp, bucket_bytes=bucket_bytes):
        buckets.append([(n, t.numel() * t.element_size()) for n, t in bucket])
        for name, tensor in bucket:
            seen.append(name)
            if not torch.equal(tensor, ckpt.read(name)):
                mismatched.append(name)
    return {"seen": seen, "names": ckpt.names(), "mismatched": mismatched, "buckets": buckets,
            "padded": model.vocab_size}


@pytest.mark.distributed
@pytest.mark.parametrize("family, tp_gen, tp_train, divisible_by, padded", [
    ("qwen2_untied", 1, 1, 128, 256),
    # Padded for training TP 4: the last 50 rows (in the second TP_g shard) are never sent.
    ("qwen2_untied", 2, 4, 100, 300),
    ("qwen3", 2, 2, 128, 256),
])
def test_hf_stream_reproduces_checkpoint(tmp_path, family, tp_gen, tp_train, divisible_by, padded):
    """The stream is the HF checkpoint, tensor for tensor: the embedding and LM head have exactly
    the HF vocabulary's rows (what vLLM's vocab-parallel weight loaders assert)."""
    from tests.models.hf_factory import save_tiny_model

    hf_dir = save_tiny_model(family, str(tmp_path / family), seed=5)
    bucket_bytes = 40_000
    results = run_on_ranks(_stream_body, tp_gen, args=(hf_dir, tp_gen, bucket_bytes, tp_train,
                                                       divisible_by), timeout=180)
    for rank, r in enumerate(results):
        assert r["padded"] == padded
        assert r["mismatched"] == [], (rank, r["mismatched"])
        assert sorted(r["seen"]) == sorted(r["names"]), rank  # every HF tensor exactly once
        assert len(r["buckets"]) > 1
        for bucket in r["buckets"]:  # bounded buckets; a larger tensor travels alone
            assert sum(b for _, b in bucket) <= bucket_bytes or len(bucket) == 1
    assert results[-1]["seen"] == results[0]["seen"]


@dataclasses.dataclass
class FakeVllmSampling:
    """Duck type of vllm.SamplingParams: the keyword arguments it accepts."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: list
    ignore_eos: bool
    seed: object
    logprobs: object
    detokenize: bool


def test_sampling_translation():
    sp = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=33,
                        stop_token_ids=(2, 7), seed=11)
    vs = to_vllm_sampling(sp, FakeVllmSampling, 3)
    assert len(vs) == 3  # one per prompt
    for v in vs:
        assert (v.n, v.temperature, v.top_p, v.top_k, v.max_tokens) == (4, 0.7, 0.9, 20, 33)
        assert v.stop_token_ids == [2, 7] and v.ignore_eos
        assert v.logprobs is None and v.detokenize is False
    # vLLM draws sample j of a request from seed + j: each prompt's seed range is its own, and
    # so is each replica's (the trainer seeds replica r with base + r).
    streams = [v.seed + j for seed in (11, 12) for v in to_vllm_sampling(
        dataclasses.replace(sp, seed=seed), FakeVllmSampling, 50) for j in range(sp.n)]
    assert len(set(streams)) == len(streams) and all(0 <= s < 2**63 for s in streams)
    assert [v.seed for v in vs] == [v.seed for v in to_vllm_sampling(sp, FakeVllmSampling, 3)]
    assert [v.seed for v in to_vllm_sampling(dataclasses.replace(sp, seed=None), FakeVllmSampling, 2)] == [None, None]
    off = to_vllm_sampling(SamplingParams(temperature=0.0, top_k=0, logprobs=True), FakeVllmSampling, 1)[0]
    assert off.top_k == -1 and off.logprobs == 0 and off.temperature == 0.0
    # vLLM's log-probs would be those of the top-k / top-p truncated distribution: refused.
    with pytest.raises(ValueError, match="truncated distribution"):
        to_vllm_sampling(dataclasses.replace(sp, logprobs=True), FakeVllmSampling, 1)
    assert to_vllm_sampling(SamplingParams(temperature=0.9, logprobs=True), FakeVllmSampling, 1)[0].logprobs == 0


def _fake_vllm(monkeypatch, calls):
    """A stand-in `vllm` module: LLM records its arguments; the TP group is this rank alone."""
    import importlib.machinery
    import sys
    import types

    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    vllm.SamplingParams = FakeVllmSampling
    vllm.LLM = lambda **kw: calls.append(kw) or SimpleNamespace()
    state = types.ModuleType("vllm.distributed.parallel_state")
    state.get_tp_group = lambda: SimpleNamespace(ranks=[0])
    for name, module in (("vllm", vllm), ("vllm.distributed", types.ModuleType("vllm.distributed")),
                         ("vllm.distributed.parallel_state", state)):
        monkeypatch.setitem(sys.modules, name, module)


def test_engine_from_config_builds_llm(monkeypatch, tmp_path):
    """build.build_generation_phase's rollout.engine=vllm branch: VLLMEngine.from_config gives vLLM the
    HF directory, prompt + response length, the actor's dtype and the rollout settings."""
    import torch.distributed as dist

    from verl_mcore.config import Config
    from verl_mcore.rollout.vllm_engine import VLLMEngine

    calls = []
    _fake_vllm(monkeypatch, calls)
    cfg = Config.load(None, ["rollout.engine=vllm", "data.max_prompt_length=48", "data.max_response_length=16",
                             "actor.dtype=bf16", "rollout.max_num_seqs=32", "rollout.gpu_memory_utilization=0.4"])
    info = SimpleNamespace(hf_dir=str(tmp_path), arch=None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    groups = SimpleNamespace(gen_tp=None)
    engine = VLLMEngine.from_config(cfg, groups, info, gen_model=None)
    [kw] = calls
    assert kw["model"] == str(tmp_path) and kw["max_model_len"] == 64 and kw["dtype"] == "bfloat16"
    assert kw["tensor_parallel_size"] == 1 and kw["max_num_seqs"] == 32
    assert kw["gpu_memory_utilization"] == 0.4 and kw["load_format"] == "dummy"
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["enable_sleep_mode"]
    assert engine.repartitioner is None and not engine.sleeping
    with pytest.raises(ValueError, match="Hugging Face directory"):
        VLLMEngine.from_config(cfg, groups, SimpleNamespace(hf_dir=None, arch=None), gen_model=None)


def _completion(index, tokens, reason, logprobs=None):
    return SimpleNamespace(index=index, token_ids=tokens, finish_reason=reason, logprobs=logprobs)


def test_output_conversion():
    sp = SamplingParams(n=2, logprobs=True)
    lp = lambda toks, vals: [{t: SimpleNamespace(logprob=v)} for t, v in zip(toks, vals)]  # noqa: E731
    requests = [
        SimpleNamespace(outputs=[_completion(1, [4, 2], "stop", lp([4, 2], [-0.5, -1.0])),
                                 _completion(0, [9, 9, 9], "length", lp([9, 9, 9], [-0.1, -0.2, -0.3]))]),
        SimpleNamespace(outputs=[_completion(0, [5], "length", [{5: -2.0}]),
                                 _completion(1, [2], "stop", lp([2], [-0.25]))]),
    ]
    out = from_vllm_outputs(requests, sp)
    assert [(o.prompt_index, o.sample_index) for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert out[0].token_ids == [9, 9, 9] and out[0].finish_reason == "length"
    assert out[1].logprobs == [-0.5, -1.0] and out[1].finish_reason == "stop"
    assert out[2].logprobs == [-2.0]
    plain = from_vllm_outputs(requests, dataclasses.replace(sp, logprobs=False))
    assert all(o.logprobs is None for o in plain)
    with pytest.raises(RuntimeError, match="expected n=3"):
        from_vllm_outputs(requests, dataclasses.replace(sp, n=3))
    # vLLM's "abort" is our "aborted" (the tokens so far); a reason we do not know is refused.
    aborted = from_vllm_outputs([SimpleNamespace(outputs=[_completion(0, [1], "abort")])],
                                SamplingParams(n=1))
    assert aborted[0].finish_reason == "aborted" and aborted[0].token_ids == [1]
    with pytest.raises(RuntimeError, match="'error'"):
        from_vllm_outputs([SimpleNamespace(outputs=[_completion(0, [1], "error")])],
                          SamplingParams(n=1))


def test_vllm_missing_is_reported():
    from verl_mcore.rollout.vllm_engine import require_vllm

    if vllm_available():
        pytest.skip("vllm is installed here")
    with pytest.raises(ImportError, match="rollout.engine=native"):
        require_vllm()


def _vllm_body(rank, world_size, hf_dir):
    from tests.rollout import engine_bodies as eb
    from verl_mcore.config import Config
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.vllm_engine import VLLMEngine

    groups = eb.setup(1, 1)
    arch, model = eb.generation_model(hf_dir, groups, 1, 1)
    model = model.cuda()
    cfg = Config.load(None, ["rollout.gpu_memory_utilization=0.3"]).rollout
    engine = VLLMEngine(hf_dir, arch, model, groups, cfg, max_model_len=64, dtype="float32")
    engine.load_weights()
    sp = SamplingParams(temperature=0.0, max_new_tokens=eb.MAX_NEW, logprobs=True)
    ours = NativeEngine(model, vocab_size=arch.vocab_size).generate(eb.PROMPTS, sp)
    theirs = engine.generate(eb.PROMPTS, sp)
    engine.sleep()
    engine.wake()
    engine.load_weights()
    again = engine.generate(eb.PROMPTS, sp)
    return {"ours": [o.token_ids for o in ours], "theirs": [o.token_ids for o in theirs],
            "again": [o.token_ids for o in again],
            "lp_diff": max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x.logprobs, y.logprobs))}


@pytest.mark.gpu
@pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")
def test_vllm_engine_end_to_end(tmp_path):
    from tests.models.hf_factory import save_tiny_model

    hf_dir = save_tiny_model("qwen2", str(tmp_path / "qwen2"), seed=3)
    [r] = run_on_ranks(_vllm_body, 1, args=(hf_dir,), timeout=600, fresh=True)
    assert r["theirs"] == r["ours"] and r["again"] == r["ours"]
    assert r["lp_diff"] < 1e-3


def test_serving_through_a_stand_in_of_vllms_request_api():
    """VLLMServer up to vLLM's engine (a stand-in: add_request / step, finishing one request a
    step): per-request budgets, stop ids and seeds from the stream, outputs mapped back to their
    request ids and (prompt, sample) indices. vLLM itself cannot run here."""
    from verl_mcore.rollout.serving import Request
    from verl_mcore.rollout.vllm_engine import VLLMServer, prompt_seeds, request_seed

    class Engine:
        def __init__(self):
            self.added = []

        def add_request(self, rid, prompt, params):
            self.added.append((rid, prompt, params))

        def step(self):
            rid, prompt, params = self.added.pop(0)
            comp = SimpleNamespace(index=0, token_ids=prompt["prompt_token_ids"][-1:] * params.max_tokens,
                                   finish_reason="length", logprobs=None)
            return [SimpleNamespace(request_id=rid, finished=True, outputs=[comp])]

    sp = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(2,), seed=1)
    engine = Engine()
    server = VLLMServer(engine, lambda **kw: SimpleNamespace(**kw), sp, max_len=16, vocab_size=50)
    a = server.submit(Request((5, 6), key=9, draws=0, max_new_tokens=3, prompt_index=4, sample_index=1))
    b = server.submit(Request((7,), key=9, draws=3, stop_token_ids=(3,)))
    (_, _, pa), (_, _, pb) = engine.added
    assert (pa.max_tokens, pa.stop_token_ids, pb.max_tokens, pb.stop_token_ids) == (3, [2], 8, [3])
    # a stream's seed, through to_vllm_sampling's per-prompt hash; another counter, another seed
    assert pb.seed == prompt_seeds(request_seed(9, 3), 1)[0] and pa.seed != pb.seed
    [(rid, out)] = server.step()
    assert (rid, out.prompt_index, out.sample_index, out.token_ids) == (a, 4, 1, [6, 6, 6])
    assert server.busy and server.step()[0][0] == b and not server.busy
    with pytest.raises(ValueError, match="exceed the session's max_len 16"):
        server.submit(Request((1,) * 10))


def test_abort_through_a_stand_in_of_vllms_request_api():
    """VLLMServer.abort up to vLLM's engine (a stand-in streaming each open request's tokens so
    far, unfinished): abort_request gets every open id, each output keeps its tokens so far
    ("aborted"), a request never stepped has none. vLLM itself cannot run here."""
    from verl_mcore.rollout.serving import Request
    from verl_mcore.rollout.vllm_engine import VLLMServer

    class Engine:
        def __init__(self):
            self.added, self.aborted, self.steps = [], [], 0

        def add_request(self, rid, prompt, params):
            self.added.append(rid)

        def step(self):
            self.steps += 1
            comp = SimpleNamespace(index=0, token_ids=[4] * self.steps, finish_reason=None,
                                   logprobs=None)
            return [SimpleNamespace(request_id=self.added[0], finished=False, outputs=[comp])]

        def abort_request(self, ids):
            self.aborted += ids

    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
    engine = Engine()
    server = VLLMServer(engine, lambda **kw: SimpleNamespace(**kw), sp, max_len=16, vocab_size=50)
    a = server.submit(Request((5, 6), key=9, prompt_index=2, sample_index=1))
    b = server.submit(Request((7,), key=8))
    assert server.step() == [] and server.step() == []
    out = server.abort()
    assert engine.aborted == [str(a), str(b)] and not server.busy
    assert [(rid, o.prompt_index, o.sample_index, o.token_ids, o.finish_reason) for rid, o in out] == [
        (a, 2, 1, [4, 4], "aborted"), (b, 0, 0, [], "aborted")]
