"""The vLLM engine: vLLM's `LLM` inside our own ranks (SPMD), fed from the generation model.

Each generation TP group is one vLLM instance (`distributed_executor_backend="external_launcher"`:
no Ray, no extra processes; every rank of the group runs the same calls). Weights never go through
disk: after the repartition, `hf_weight_stream` all-gathers each tensor's TP_g shards within the
generation TP group, renames and re-lays it out to Hugging Face form (models/weight_map, the one
place for that mapping) and hands vLLM buckets of full HF tensors, which its weight loaders slice
for their own TP rank. Between phases vLLM sleeps (level 2: weights and KV cache discarded; they
are re-pushed at the next update) and the prefix cache is reset after every update, since cached
prompt KV was computed with the old weights.

vLLM is optional: nothing here imports it at module import time; `VLLMEngine` raises with an
install hint when it is missing. What runs without vLLM (and is unit-tested on CPU): the tensor
stream, the sampling-parameter translation and the output conversion. What needs vLLM (a GPU test,
skipped where `import vllm` fails): the `LLM` construction, weight loading and generation.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from verl_mcore.config.seeds import rollout_config
from verl_mcore.models import weight_map as wm
from verl_mcore.models.hf_config import HFArch
from verl_mcore.models.hf_weights import named_canonical_parameters
from verl_mcore.rollout.base import RolloutEngine, SampleOutput, SamplingParams
from verl_mcore.rollout.sampling import sequence_keys
from verl_mcore.rollout.serving import Request, Server, check_request

DEFAULT_BUCKET_BYTES = 512 << 20


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm():
    if not vllm_available():
        raise ImportError("rollout.engine=vllm needs the `vllm` package (pip install vllm, matching "
                          "your torch build); or set rollout.engine=native")
    import vllm  # optional heavy dependency: only rollout.engine=vllm imports it

    return vllm


# ------------------------------------------------------------------------------------------------
# Weights: generation model -> stream of Hugging Face tensors

def _gather_full(shard: torch.Tensor, pm: wm.ParamMap, tp_group) -> torch.Tensor:
    """The full megatron tensor from this rank's TP_g shard (all-gather within `tp_group`)."""
    size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if size == 1 or pm.kind == "replicated":
        return shard
    parts = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(parts, shard.contiguous(), group=tp_group)
    return wm.tp_merge(pm, parts)


def hf_weight_stream(model: torch.nn.Module, arch: HFArch, tp_group=None, role: str = "actor",
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES
                     ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (HF name, full HF tensor) from a generation-layout model (no PP).

    Collective over `tp_group` (every rank of the group must consume the stream). One megatron
    tensor is gathered at a time and a bucket holds at most `bucket_bytes` (a single larger tensor
    goes alone), so no rank ever holds more than one bucket plus one tensor in flight beside its
    shard. Fused QKV and gate/up are split back into HF tensors.

    The embedding and LM head go out as HF has them, `arch.vocab_size` rows: our padding rows
    (up to the training layout's padded size) are dropped. vLLM wants exactly that: its
    VocabParallelEmbedding / ParallelLMHead weight loader asserts that the loaded tensor has the
    config's vocab_size rows and zero-fills vLLM's own padding rows (it pads to a multiple of 64),
    and its LogitsProcessor cuts the logits to vocab_size before sampling, so no padding id of
    either side can be sampled.
    """
    maps = {pm.mcore: pm for pm in wm.param_maps(arch, role)}
    bucket: list[tuple[str, torch.Tensor]] = []
    held = 0
    for name, param in named_canonical_parameters(model):
        pm = maps.get(name)
        if pm is None and name == "output_layer.weight" and arch.tie_embeddings:
            continue  # a tied head is the embedding, streamed once as model.embed_tokens
        if pm is None:
            raise KeyError(f"hf_weight_stream: no HF name for generation parameter {name!r} "
                           f"(role {role}, model_type {arch.model_type})")
        full = _gather_full(param.detach(), pm, tp_group)
        for hf_name, tensor in wm.mcore_to_hf(pm, arch, full).items():
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and held + nbytes > bucket_bytes:
                yield bucket
                bucket, held = [], 0
            bucket.append((hf_name, tensor))
            held += nbytes
    if bucket:
        yield bucket


# ------------------------------------------------------------------------------------------------
# Sampling parameters and outputs

def prompt_seeds(seed: Optional[int], num_prompts: int) -> list[Optional[int]]:
    """One vLLM seed per prompt. vLLM seeds sample j of a request with `seed + j`, so one seed
    for every prompt would give sample j of every prompt (and of the next replica, seeded
    seed + 1 by the trainer) the same random stream. Each prompt's base is a 62-bit hash of
    (seed, prompt index) (sampling.sequence_keys, as the native engine's streams)."""
    if seed is None:
        return [None] * num_prompts
    keys = sequence_keys(seed, np.arange(num_prompts), np.zeros(num_prompts, dtype=np.int64))
    return [int(k >> np.uint64(2)) for k in keys]


def to_vllm_sampling(sp: SamplingParams, sampling_cls: Any, num_prompts: int) -> list[Any]:
    """Our SamplingParams -> one vllm.SamplingParams per prompt (`sampling_cls`, passed in so this
    is testable without vLLM), each with its own seed (`prompt_seeds`). Only `stop_token_ids` end
    a sequence (vLLM's implicit EOS stop is off: the trainer passes the tokenizer's eos ids
    explicitly); text is never detokenized.

    Log-probs are vLLM's "processed" ones (after temperature, the trainer's definition); vLLM
    takes them after top-k / top-p too, where ours (base.py) are before them, so that
    combination is refused rather than returned with another meaning."""
    if sp.logprobs and not sp.greedy and (sp.top_p < 1.0 or sp.top_k > 0):
        raise ValueError("vLLM engine: logprobs=True with top_p < 1 or top_k > 0 would give the "
                         "log-probs of the truncated distribution, not the model's (SamplingParams"
                         ".logprobs); sample without them or set top_p=1, top_k=-1")
    return [sampling_cls(
        n=sp.n,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k if sp.top_k > 0 else -1,
        max_tokens=sp.max_new_tokens,
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=True,
        seed=seed,
        logprobs=0 if sp.logprobs else None,  # 0: only the sampled token's log-prob
        detokenize=False,
    ) for seed in prompt_seeds(sp.seed, num_prompts)]


def _logprob_of(entry: Any, token: int) -> float:
    """vLLM gives, per position, a mapping token id -> Logprob (with `.logprob`) or a float."""
    value = entry[token]
    return float(getattr(value, "logprob", value))


# vLLM's finish reasons -> ours (rollout/base.py FinishReason): an aborted request's tokens so far.
_FINISH = {"stop": "stop", "length": "length", "abort": "aborted"}


def from_vllm_outputs(request_outputs: Sequence[Any], sp: SamplingParams) -> list[SampleOutput]:
    """vLLM RequestOutputs (one per prompt, in prompt order) -> our SampleOutputs ordered by
    (prompt_index, sample_index)."""
    results = []
    for prompt_index, request in enumerate(request_outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != sp.n:
            raise RuntimeError(f"vLLM returned {len(completions)} samples for prompt "
                               f"{prompt_index}, expected n={sp.n}")
        for c in completions:
            tokens = [int(t) for t in c.token_ids]
            if c.finish_reason not in _FINISH:
                raise RuntimeError(f"vLLM finished prompt {prompt_index} sample {c.index} with "
                                   f"{c.finish_reason!r} (expected one of {list(_FINISH)})")
            logprobs = None
            if sp.logprobs:
                if c.logprobs is None or len(c.logprobs) != len(tokens):
                    raise RuntimeError(f"vLLM returned no per-token log-probs for prompt "
                                       f"{prompt_index} sample {c.index}")
                logprobs = [_logprob_of(entry, t) for entry, t in zip(c.logprobs, tokens)]
            results.append(SampleOutput(prompt_index=prompt_index, sample_index=c.index,
                                        token_ids=tokens, logprobs=logprobs,
                                        finish_reason=_FINISH[c.finish_reason]))
    return results


# ------------------------------------------------------------------------------------------------
# Step-wise serving (rollout/serving.py) through vLLM's request API

def request_seed(key: int, draws: int) -> int:
    """vLLM's seed of a request: a 62-bit hash of its stream (key, draws). vLLM draws from a
    generator seeded per request, not from counters, so a continuation is reproducible for the
    same (key, draws), but a request's tokens are not those the native engine's counters give."""
    return int(sequence_keys(key & 0xFFFFFFFFFFFFFFFF, np.array([draws]), np.zeros(1, dtype=np.int64))[0]
               >> np.uint64(2))


class VLLMServer(Server):
    """A serving session over vLLM's engine (`llm_engine`: add_request, step,
    has_unfinished_requests). Sessions need no bookkeeping here: vLLM's prefix cache
    (enable_prefix_caching) finds a continuation's prefix blocks by their tokens, and evicts them
    itself; `release` is a no-op. Untested against vLLM (it cannot be installed here: FINDINGS):
    only with a stand-in of its engine."""

    def __init__(self, llm_engine, sampling_cls, sampling: SamplingParams, max_len: int, vocab_size: int):
        self.llm_engine, self.sampling_cls, self.sp = llm_engine, sampling_cls, sampling
        self.max_len, self.vocab_size = max_len, vocab_size
        self.requests: dict[str, tuple[int, Request]] = {}
        self.partial: dict[str, Any] = {}  # request id -> its latest unfinished RequestOutput
        self.next_id = 0
        self.finished = 0

    def submit(self, request: Request) -> int:
        sp = dataclasses.replace(self.sp, n=1, max_new_tokens=request.max_new_tokens or self.sp.max_new_tokens,
                                 stop_token_ids=(self.sp.stop_token_ids if request.stop_token_ids is None
                                                 else request.stop_token_ids),
                                 seed=request_seed(request.key, request.draws))
        rid = self.next_id
        check_request(dataclasses.replace(request, max_new_tokens=sp.max_new_tokens), self.vocab_size,
                      self.max_len, f"VLLMEngine.serving: request {rid}")
        [vsp] = to_vllm_sampling(sp, self.sampling_cls, 1)
        self.llm_engine.add_request(str(rid), {"prompt_token_ids": list(request.token_ids)}, vsp)
        self.requests[str(rid)] = (rid, dataclasses.replace(request, max_new_tokens=sp.max_new_tokens))
        self.next_id += 1
        return rid

    def step(self) -> list[tuple[int, SampleOutput]]:
        if not self.requests:
            return []
        done = []
        for out in self.llm_engine.step():
            if not out.finished:
                self.partial[out.request_id] = out  # its tokens so far, for `abort`
                continue
            self.partial.pop(out.request_id, None)
            rid, request = self.requests.pop(out.request_id)
            [sample] = from_vllm_outputs([out], dataclasses.replace(self.sp, n=1))
            done.append((rid, dataclasses.replace(sample, prompt_index=request.prompt_index,
                                                  sample_index=request.sample_index)))
        self.finished += len(done)
        return done

    @property
    def busy(self) -> bool:
        return bool(self.requests)

    def release(self, session) -> None:
        pass  # vLLM's prefix cache keeps and evicts blocks by their tokens

    def abort(self) -> list[tuple[int, SampleOutput]]:
        """vLLM's abort_request on every open request; each one's tokens are those of its latest
        step output (none for a request vLLM had not scheduled yet). Untested against vLLM."""
        names = sorted(self.requests, key=lambda name: self.requests[name][0])
        if names:
            self.llm_engine.abort_request(names)
        out = []
        for name in names:
            rid, request = self.requests.pop(name)
            seen = self.partial.pop(name, None)
            tokens, logprobs = [], [] if self.sp.logprobs else None
            if seen is not None:
                [c] = seen.outputs
                tokens = [int(t) for t in c.token_ids]
                if self.sp.logprobs and c.logprobs is not None:
                    logprobs = [_logprob_of(entry, t) for entry, t in zip(c.logprobs, tokens)]
            out.append((rid, SampleOutput(prompt_index=request.prompt_index,
                                          sample_index=request.sample_index, token_ids=tokens,
                                          logprobs=logprobs, finish_reason="aborted")))
        return out

    def stats(self) -> dict[str, float]:
        return {"rollout/requests_finished": float(self.finished)}


# ------------------------------------------------------------------------------------------------
# The engine

def _vllm_model(llm: Any) -> torch.nn.Module:
    """The in-process model of an external-launcher LLM (the attribute path moved between vLLM
    versions: V0 engine, then V1 with the in-process engine core)."""
    paths = ("llm_engine.model_executor.driver_worker.worker.model_runner.model",
             "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model")
    for path in paths:
        obj = llm
        try:
            for attr in path.split("."):
                obj = getattr(obj, attr)
        except AttributeError:
            continue
        return obj
    raise RuntimeError("vLLM engine: cannot find the in-process model (tried "
                       f"{', '.join(paths)}); this vLLM version is not supported")


class VLLMEngine(RolloutEngine):
    """vLLM in SPMD mode, one instance per generation TP group.

    hf_dir: the HF model directory (config and tokenizer; weights are pushed, not read:
        `load_format="dummy"`). gen_model: the generation-layout GPTModel the stream reads (the
        training model itself when the layouts agree). groups: ParallelGroups (gen_tp must be
        consecutive ranks, as vLLM's external launcher forms its TP groups that way).
    repartitioner: fills gen_model before each push (None: gen_model is the training model).
    """

    logprobs_when_truncated = False  # to_vllm_sampling refuses them

    @classmethod
    def from_config(cls, cfg, groups, info, gen_model: torch.nn.Module, repartitioner=None
                    ) -> "VLLMEngine":
        """The engine of rollout.engine=vllm (build.build_generation_phase): the HF directory
        gives vLLM its config and tokenizer, sequences are at most prompt + response long, and
        vLLM computes in the actor's dtype (the weights it receives)."""
        if not info.hf_dir:
            raise ValueError("rollout.engine=vllm needs model.path to be a Hugging Face directory "
                             "(vLLM reads its config.json and tokenizer there)")
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[cfg.actor.dtype]
        return cls(info.hf_dir, info.arch, gen_model, groups, rollout_config(cfg),
                   max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
                   dtype=dtype, repartitioner=repartitioner)

    def __init__(self, hf_dir: str, arch: HFArch, gen_model: torch.nn.Module, groups, rollout_cfg,
                 *, max_model_len: int, dtype: str = "bfloat16", repartitioner=None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        vllm = require_vllm()
        self.vllm = vllm
        self.arch, self.gen_model, self.groups = arch, gen_model, groups
        self.repartitioner = repartitioner
        self.keep_weights_buffer = rollout_cfg.keep_weights_buffer
        self.bucket_bytes = bucket_bytes
        # The external launcher runs the engine core in this process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.llm = vllm.LLM(
            model=hf_dir,
            tensor_parallel_size=rollout_cfg.tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            load_format="dummy",
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=rollout_cfg.max_num_seqs,
            gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
            enable_sleep_mode=True,
            enable_prefix_caching=True,
            seed=rollout_cfg.seed,
            logprobs_mode="processed_logprobs",  # after temperature, as the trainer recomputes
        )
        self._check_groups()
        self.sleeping = False

    def _check_groups(self) -> None:
        from vllm.distributed.parallel_state import get_tp_group  # optional: vllm

        theirs = list(get_tp_group().ranks)
        ours = dist.get_process_group_ranks(self.groups.gen_tp) if dist.get_world_size(
            self.groups.gen_tp) > 1 else [dist.get_rank()]
        if theirs != ours:
            raise RuntimeError(
                f"vLLM engine on rank {dist.get_rank()}: vLLM's TP group is {theirs} but the "
                f"generation TP group is {ours}; vLLM's external launcher groups consecutive ranks, "
                "which matches only when rollout.tensor_parallel_size equals the training TP size")

    def load_weights(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.repartitioner is not None:
            stats = self.repartitioner.run()
            metrics["rollout/repartition_seconds"] = stats.seconds
            metrics["rollout/repartition_bytes_received"] = float(stats.bytes_received)
        if self.sleeping:
            # vLLM allocates its weights and KV cache outside torch's caching allocator: memory
            # torch holds cached (freed training state, the reference's offloaded weights) must
            # go back to the driver first, as the native engine's wake does.
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])  # the KV cache comes back after the push
        model = _vllm_model(self.llm)
        pushed = 0
        for bucket in hf_weight_stream(self.gen_model, self.arch, self.groups.gen_tp,
                                       bucket_bytes=self.bucket_bytes):
            model.load_weights(bucket)
            pushed += sum(t.numel() * t.element_size() for _, t in bucket)
        if self.repartitioner is not None and not self.keep_weights_buffer:
            self.repartitioner.buffer.release()
        if self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        self.llm.reset_prefix_cache()
        metrics["rollout/weights_pushed_bytes"] = float(pushed)
        return metrics

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams
                 ) -> list[SampleOutput]:
        vsp = to_vllm_sampling(sampling, self.vllm.SamplingParams, len(prompt_token_ids))
        prompts = [{"prompt_token_ids": list(map(int, p))} for p in prompt_token_ids]
        outputs = self.llm.generate(prompts, vsp, use_tqdm=False)  # one SamplingParams per prompt
        return from_vllm_outputs(outputs, sampling)

    @contextlib.contextmanager
    def serving(self, sampling: SamplingParams, *, max_len: int, sessions: int):
        """Step-wise serving through vLLM's request API (VLLMServer); untested here."""
        yield VLLMServer(self.llm.llm_engine, self.vllm.SamplingParams, sampling, max_len,
                         self.arch.vocab_size)

    def sleep(self) -> None:
        # Level 2: discard weights and KV cache; the next load_weights pushes the weights again.
        self.llm.sleep(level=2)
        self.sleeping = True
        if self.repartitioner is not None and not self.keep_weights_buffer:
            self.repartitioner.buffer.release()

    def wake(self) -> None:
        # vLLM's memory comes back inside load_weights (weights first, KV cache after the push,
        # so the gathered buckets never coexist with the cache).
        if self.repartitioner is not None:
            self.repartitioner.buffer.restore()
