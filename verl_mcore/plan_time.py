"""The planner's phase-time model: seconds per step of a config on G GPUs, colocated or with a
rollout set of its own, and the rollout / training split it recommends (issue 23).

    python -m verl_mcore.plan --config configs/ppo_llama3_70b.yaml --nodes 8 --gpus-per-node 8 \
        [--gpu-kind h100|h200] [--response-fraction 0.5]

prints, after the memory report, the modelled seconds per step of the fastest layouts and the
placement / rollout.mode lines of the fastest one (--json: "rollout_split"). --gpu-kind picks
the rates below (default: h200 when --gpu-memory-gb is above 100, else h100).

Pure arithmetic on the config and the model shape (planning/memory.py ModelDims); no torch, no GPU. It is a
model: bounds from measured hardware rates, scaled by measured efficiencies of this code on one
GPU. What it leaves out is listed at the end of this docstring and in the planner's output.

Symbols. B = data.train_batch_size prompts, n = rollout.n, P = data.max_prompt_length,
Rl = data.max_response_length, L layers, h hidden, f FFN, a / kv attention / KV heads, hd head
dim, V vocabulary, t / p / c = training TP / PP / CP, TP_g = rollout.tensor_parallel_size.
Linear weights of one layer: W_layer = h·(a + 2·kv)·hd + a·hd·h + 3·h·f (SwiGLU).

Generation on R GPUs (`generation_seconds`), the native engine's work as bench/roofline.py
bounds it, per replica of TP_g GPUs; the R / TP_g replicas run in parallel:
  sequences     S = ceil(B·n / (R / TP_g)) per replica, decoded in waves of at most
                rollout.max_num_seqs (continuous batching refills finished slots; with every
                response of one length the waves are exact): waves = ceil(S / max_num_seqs).
  response      every response runs to Rl·response_fraction tokens (default 1.0: to the limit,
                as random-weight benches do; real responses stop earlier: pass the fraction);
                the first new token comes from the prefill, so D = Rl·response_fraction − 1
                decode steps per wave.
  prefill       per GPU: S·(2·L·W_layer·P + 2·L·a·hd·P² + 2·V·h) / TP_g FLOPs (linears, causal
                attention, the last prompt token's logits), every prompt P tokens long, at
                matmul_flops_per_s.
  decode        per GPU: waves·D·W_g + S·K_g·(D·P + D·(D+1)/2) bytes at copy_bytes_per_s, where
                W_g = 2·(L·layer_params(TP_g) + h + V·h/TP_g) is the bf16 weight shard a decode
                step reads (the output layer whole, the embedding only by rows; with
                rollout.dtype=fp8 the layers' linears count 1 byte a weight and 4 per output
                row, `decode_weight_bytes`) and
                K_g = 2·L·max(kv/TP_g, 1)·hd·2 the KV bytes per token on one GPU (planning/memory.py's KV
                cache term; heads replicate when TP_g > kv); decode step d reads P + d tokens
                of every live sequence.
  seconds       (prefill + decode) / rollout_efficiency. At TP_g = 1, one replica and one wave
                this is exactly bench/roofline.generation_bound / rollout_efficiency
                (tests/hpc/test_plan_split.py checks it).

Training on T GPUs (`training_seconds`), model FLOPs as engine/flops.py counts them (what MFU
is measured against): per sample of s = (P + Rl)·length_fraction tokens (default 1.0),
forward F(N) = 2·N·s + 2·L·a·hd·s·(s + 1), N = L·W_layer + h·V (actor, reference) or + h
(critic: its value head); with LoRA the same (its update measured as fast as the full one,
RESULTS.md 2026-12-04 18:40). The passes of a step:
  actor update       3·F(N_actor)·actor.ppo_epochs (forward + backward = 6N per token)
  old log-probs      F(N_actor) when the pass runs (Learner.needs_old_log_probs: not for one
                     on-policy optimizer step without in-reward KL; always in one_step_off,
                     whose samples come from the previous weights, and under rollout.tis_cap or
                     rollout.correction, which weigh against it)
  reference          F(N_actor) when a KL term reads it (actor.use_kl_loss,
                     algorithm.use_kl_in_reward)
  critic (GAE)       values pass F(N_critic) where it runs (cfg.critic_values_pass) and the
                     update 3·F(N_critic)·(critic.ppo_epochs or actor.ppo_epochs)
  × B·n samples, × 4/3 for an update under *.recompute_activations (one more forward: hardware
  FLOPs), × the 1F1B pipeline bubble 1 + (p − 1)/(vpp·m) with m micro-batches per schedule on a
  rank (Narayanan et al. 2021, arXiv 2104.04473), / (T · matmul_flops_per_s ·
  train_efficiency). Plus, where the memory plan offloads gradients and optimizer states
  between phases (memory.choose_offload's rule), 2 · offloaded bytes per GPU / host_copy_bytes_per_s.

Weight transfer to a rollout set of its own (`transfer_seconds`, rollout/cross_set.py's routes):
each rollout rank receives its bf16 TP_g shard, 2·stage_params(TP_g) bytes; each actor rank of
DP replica r serves the rollout replicas ≡ r mod DP_T, sending its whole shard to each:
ceil((R/TP_g) / DP_T) · 2·stage_params(t, p) bytes. Seconds = the larger of the two / link
bandwidth: link_bytes_per_s on one node, network_bytes_per_s when the job spans nodes (the sets
then sit on different nodes for most routes). Both are assumptions, not measurements.

Step seconds of a layout (`Split.step_s`; train includes the offload term):
  colocated sync          gen(G) + train(G)     (the in-place repartition is not counted)
  rollout set R, sync     gen(R) + train(G − R) + transfer
  rollout set R, one_step_off   max(gen(R), train(G − R)) + transfer: generation of batch t+1
                          overlaps the update on batch t, so the update trains on samples of the
                          policy one update old (staleness 1). Its train() always includes the
                          old-log-prob pass (rollout.tis_cap weighs against it), so where that
                          pass costs more than generation, one_step_off is slower than sync.
Candidates R: every multiple of TP_g from TP_g up, leaving T = G − R ranks that hold the actor's
t·p·c (divisibility) and satisfying the batch rules of config/validate.py (the actor's mini-batch
over DP_T, the B prompts over the R / TP_g generation groups). R need not be whole nodes: the
rollout set is the last R ranks, so with t and TP_g dividing the GPUs per node every TP and TP_g
group still lies inside one node. A candidate whose training set or rollout set does not fit
the GPU (memory.plan_memory without the generate phase; generation weights + KV + engine overhead
on the rollout set) is left out of the recommendation.

Hardware constants (`HARDWARE`), measured in this repository:
  H200 copy 4.17 TB/s: FINDINGS.md "The GPU machine's image (H200)", 2026-12-02 (bench_kernels
       measured 4.23 / 4.25 TB/s, RESULTS.md 2026-12-02 12:31 and 12:55).
  H200 matmul 760 TFLOP/s: bf16 8192³ GEMM, measured 719–781 TFLOP/s in the bench suites on
       different instances (RESULTS.md 2026-12-02 14:46 to 2026-12-03 17:48; 771 in the
       2026-12-03 08:49 suite; one LoRA run measured 680, 2026-12-04 18:40).
  train_efficiency 0.58: the actor update's model FLOPs against the same run's matmul ceiling,
       3B 58.8% (453 of 771 TFLOP/s, 45.8% MFU against the 989 datasheet peak; RESULTS.md
       2026-12-03 08:49) and 59.6% (08:24); the 1.5B GRPO step's update 45.4% MFU ≈ 58% (13:55).
       The forward-only passes run alike: at 0.58 the model gives the 1.5B step's update
       11.3 s and reference pass 3.8 s against 11.11 and 3.97 s measured (13:55).
  rollout_efficiency, the native engine's share of its bound (bench/roofline.py at 4.17 TB/s,
       recomputed from the measured seconds): H200 0.40, its generate phase inside the trainer's
       GRPO step (512 sequences of 512 + 512 tokens, 512 slots): 6.60 s = 40% (RESULTS.md
       2026-12-02 15:40), 6.48 / 6.37 / 6.39 s = 41–42% (2026-12-03 08:24, 08:49, 13:55); the
       engine alone at smaller batches measured less: 27% (2026-12-02 15:40) and 29%
       (2026-12-03 08:49) at batch 128 × (256 + 256), 33% at batch 64 × (1024 + 1024)
       (2026-12-02 15:40). H100 0.33: the only
       H100 figure, batch 128 × (256 + 256) (2026-12-05 16:15), likely low as on the H200. One
       efficiency for prefill and decode together, as the shares were measured on their sum.
  host_copy_bytes_per_s 4.6 GB/s: offload on at the 1.5B GRPO step cost 10.8 s a step
       (RESULTS.md 2026-12-02 15:40, 38.80 against 28.17 s) for 24.7 GB of gradients and
       optimizer state each way: 2 · 24.7 GB / 10.8 s.
  H100 copy 3.00 TB/s, matmul 782 TFLOP/s, rollout 33%: RESULTS.md 2026-12-05 16:15. Its
       train_efficiency and host copy rate are the H200's (not measured on H100).
  link_bytes_per_s 100 GB/s (an NVLink-class point-to-point rate within a node) and
       network_bytes_per_s 50 GB/s (one 400 Gb/s NIC per GPU): nominal assumptions, not
       measured here.

Against the 1.5B GRPO step measured on one H200 (RESULTS.md 2026-12-03 13:55; 64 prompts × 8,
512 + 512 tokens, KL loss): generate 6.70 s modelled / 6.39 measured, actor update + reference
15.1 / 15.08 s; the PPO step's actor + reference + critic update 24.8 / 25.05 s
(tests/hpc/test_plan_split.py holds these). The efficiencies were read off these same runs, so
this checks the arithmetic, not the model's power to predict: no step on more than one GPU, no
TP > 1, no pipeline and no rollout set of its own has been timed against it.

Left out: tensor-parallel and data-parallel communication (the efficiencies were measured at
TP = 1 on one GPU; TP_g > 1 adds two all-reduces per layer to every decode step), the in-place
repartition and weight-sync check of the colocated step, reward models and rule rewards,
generation memory beyond rollout.max_num_seqs (a rollout set of its own has room for more
sequences), prompts shorter than P, responses of unequal length (stragglers keep a wave
going), and the vLLM engine (its efficiency was not measured here; the native one's is used).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

from verl_mcore.config import Config
from verl_mcore.config.schema import padded_micro_batches
from verl_mcore.planning.memory import (RUNTIME_OVERHEAD_GIB, USABLE_FRACTION, GiB, Knobs, ModelDims,
                                        _micro_tokens, _num_microbatches, _uses_reference,
                                        choose_token_budgets,
                                        generation_bytes, layer_params, misfits, plan_memory,
                                        stage_params)


@dataclass(frozen=True)
class Hardware:
    """Rates of one GPU kind and of this code on it (the module docstring has their sources)."""

    name: str
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written per second
    matmul_flops_per_s: float  # bf16 dense GEMM ceiling, measured
    train_efficiency: float  # training model FLOPs / the matmul ceiling
    rollout_efficiency: float  # the generation bound (bench/roofline.py) / measured seconds
    host_copy_bytes_per_s: float  # offloaded state moved per second of step time, each way summed
    link_bytes_per_s: float = 100e9  # actor set -> rollout set within a node (assumed)
    network_bytes_per_s: float = 50e9  # actor set -> rollout set across nodes (assumed)


HARDWARE = {
    # FINDINGS.md 2026-12-02; RESULTS.md 2026-12-02 14:46 to 2026-12-03 13:55
    "h200": Hardware("h200", 4.17e12, 760e12, 0.58, 0.40, 4.6e9),
    # RESULTS.md 2026-12-05 16:15 (copy, matmul, rollout share); training and host copy: H200's
    "h100": Hardware("h100", 3.00e12, 782e12, 0.58, 0.33, 4.6e9),
}


# ---------------------------------------------------------------------------------------------
# Phase times
# ---------------------------------------------------------------------------------------------

def _linear_weights(dims: ModelDims) -> int:
    """L·W_layer: the decoder layers' matmul weights (no norms, biases or embedding)."""
    h, hd = dims.hidden_size, dims.head_dim
    a, kv = dims.num_attention_heads * hd, dims.num_key_value_heads * hd
    return dims.num_layers * (h * (a + 2 * kv) + a * h + 3 * h * dims.ffn_hidden_size)


def generation_seconds(cfg: Config, dims: ModelDims, gpus: int, hw: Hardware,
                       response_fraction: float = 1.0) -> float:
    """Seconds to sample the step's B·n responses on `gpus` GPUs in replicas of TP_g."""
    r, d = cfg.rollout, cfg.data
    tp_g = r.tensor_parallel_size
    seqs = math.ceil(d.train_batch_size * r.n / (gpus // tp_g))  # S, per replica
    waves = math.ceil(seqs / r.max_num_seqs)
    steps = max(round(d.max_response_length * response_fraction) - 1, 0)  # D
    h, v, prompt = dims.hidden_size, dims.vocab_size, d.max_prompt_length
    weights = decode_weight_bytes(dims, tp_g, r.dtype == "fp8")  # W_g
    kv_token = 2 * dims.num_layers * max(dims.num_key_value_heads // tp_g, 1) * dims.head_dim * 2
    decode = waves * steps * weights + seqs * kv_token * (steps * prompt + steps * (steps + 1) / 2)
    attention = 2 * dims.num_layers * dims.num_attention_heads * dims.head_dim * prompt ** 2
    prefill = seqs * (2 * _linear_weights(dims) * prompt + attention + 2 * v * h) / tp_g
    bound = decode / hw.copy_bytes_per_s + prefill / hw.matmul_flops_per_s
    return bound / hw.rollout_efficiency


def decode_weight_bytes(dims: ModelDims, tp_g: int, fp8: bool) -> float:
    """W_g: the weight bytes one GPU reads per decode step (bf16; an FP8 generation copy's
    linears at 1 byte a weight plus a 4-byte scale per output row, rollout/fp8_weights.py)."""
    h, v, hd = dims.hidden_size, dims.vocab_size, dims.head_dim
    # A MoE model's every expert counts: a decode batch of many sequences touches most of them
    # (FP8 generation refuses MoE models, so the FP8 arithmetic below is the dense layer's).
    layers = sum(2 * layer_params(dims, tp_g, layer) for layer in range(dims.num_layers))
    per_layer = 2 * layer_params(dims, tp_g)
    if fp8:
        q = dims.num_attention_heads * hd // tp_g
        kv = max(dims.num_key_value_heads // tp_g, 1) * hd
        f = dims.ffn_hidden_size // tp_g
        linear = h * (q + 2 * kv) + q * h + 3 * h * f
        rows = (q + 2 * kv) + h + 2 * f + h
        per_layer -= 2 * linear - (linear + 4 * rows)
    if not fp8:
        return layers + 2 * (h + v * h / tp_g)
    return dims.num_layers * per_layer + 2 * (h + v * h / tp_g)


def _needs_old_log_probs(cfg: Config, stale: bool = False) -> bool:
    """Learner.needs_old_log_probs from the config; `stale` (one_step_off), fully_async or
    rollout.partial: the samples come (partly) from earlier weights, so the update's own
    log-probs are not the old ones; weighed against the engine's log-probs (rollout.tis_cap, rollout.correction), the
    pass always runs."""
    a = cfg.actor
    on_policy = a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.data.train_batch_size
    return (stale or cfg.rollout.partial.enable or cfg.rollout.mode == "fully_async"
            or a.recompute_old_log_probs == "always"
            or cfg.algorithm.use_kl_in_reward or not on_policy or cfg.rollout.weighs_engine_log_probs)


def _bubble(cfg: Config, microbatches: int) -> float:
    """1F1B pipeline time over the ideal: 1 + (p − 1) / (vpp · m)."""
    p = cfg.parallel
    vpp = p.virtual_pipeline_model_parallel_size or 1
    return 1 + (p.pipeline_model_parallel_size - 1) / (vpp * microbatches)


def training_seconds(cfg: Config, dims: ModelDims, gpus: int, hw: Hardware,
                     length_fraction: float = 1.0, stale: bool = False) -> float:
    """Seconds of the step's forward-only passes and updates on `gpus` GPUs (no offload)."""
    p, d = cfg.parallel, cfg.data
    dp = gpus // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                  * p.context_parallel_size)
    samples = d.train_batch_size * cfg.rollout.n
    s = round((d.max_prompt_length + d.max_response_length) * length_fraction)
    attention = 2 * dims.num_layers * dims.num_attention_heads * dims.head_dim * s * (s + 1)

    def forward(head: int) -> float:  # F(N) over the batch
        return samples * (2 * (_linear_weights(dims) + dims.hidden_size * head) * s + attention)

    def fwd_microbatches(role: str) -> int:  # the whole batch on a rank, one schedule
        tokens, per_micro = _micro_tokens(cfg, role)
        per_rank = math.ceil(samples / dp)
        full = d.max_prompt_length + d.max_response_length
        return math.ceil(per_rank / per_micro) if per_micro else math.ceil(per_rank * full / tokens)

    def update(role: str, head: int, epochs: int) -> float:
        recompute = 4 / 3 if getattr(cfg, role).recompute_activations else 1.0
        bubble = _bubble(cfg, _num_microbatches(cfg, role, dp))
        return 3 * forward(head) * epochs * recompute * bubble

    fwd_actor = forward(dims.vocab_size) * _bubble(cfg, fwd_microbatches("actor"))
    flops = update("actor", dims.vocab_size, cfg.actor.ppo_epochs)
    flops += fwd_actor * (_needs_old_log_probs(cfg, stale) + _uses_reference(cfg))
    if cfg.uses_critic:
        if cfg.critic_values_pass:
            flops += forward(1) * _bubble(cfg, fwd_microbatches("critic"))
        flops += update("critic", 1, cfg.critic.ppo_epochs or cfg.actor.ppo_epochs)
    return flops / (gpus * hw.matmul_flops_per_s * hw.train_efficiency)


def transfer_seconds(cfg: Config, dims: ModelDims, rollout_gpus: int, training_gpus: int,
                     hw: Hardware, one_node: bool) -> float:
    """Seconds to send the actor's weights to a rollout set of its own (rollout/cross_set.py)."""
    p, div = cfg.parallel, cfg.model.make_vocab_size_divisible_by
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    tp_g = cfg.rollout.tensor_parallel_size
    received = 2 * stage_params(dims, tp_g, 1, 0, div, vocab_tp=tp)
    dp = training_gpus // (tp * pp * p.context_parallel_size)
    shard = max(2 * stage_params(dims, tp, pp, stage, div) for stage in range(pp))
    sent = math.ceil(rollout_gpus // tp_g / dp) * shard
    return max(received, sent) / (hw.link_bytes_per_s if one_node else hw.network_bytes_per_s)


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    """One layout's modelled step. rollout_gpus = 0: colocated (every phase on every GPU)."""

    rollout_gpus: int
    training_gpus: int
    mode: str  # "sync" | "one_step_off"
    generate_s: float
    train_s: float  # forward passes and updates
    offload_s: float  # host round trips of the offloaded state (0 without offload)
    transfer_s: float
    misfit: str = ""  # the set that does not fit the GPU ("" fits, with offload where offload_s > 0)

    @property
    def fits(self) -> bool:
        return not self.misfit

    @property
    def step_s(self) -> float:
        busy = self.train_s + self.offload_s
        if self.mode == "one_step_off":
            return max(self.generate_s, busy) + self.transfer_s
        return self.generate_s + busy + self.transfer_s

    @property
    def colocated(self) -> bool:
        return self.rollout_gpus == 0

    def busy(self) -> tuple[float, float]:
        """(rollout set, training set) busy seconds / step seconds, transfer not counted."""
        return self.generate_s / self.step_s, (self.train_s + self.offload_s) / self.step_s

    def name(self) -> str:
        if self.colocated:
            return f"colocated, {self.training_gpus} GPU{'s' * (self.training_gpus > 1)}, sync"
        return f"rollout {self.rollout_gpus} + training {self.training_gpus}, {self.mode}"

    def overrides(self) -> str:
        """The config lines that select this layout."""
        if self.colocated:
            return "placement.actor=null placement.rollout=null rollout.mode=sync (the default)"
        t, world = self.training_gpus, self.training_gpus + self.rollout_gpus
        return (f'placement.actor="0-{t - 1}" placement.rollout="{t}-{world - 1}" '
                f"rollout.mode={self.mode}")

    def as_dict(self) -> dict:
        rollout, training = self.busy()
        return asdict(self) | {"fits": self.fits, "step_s": self.step_s, "busy_rollout": rollout,
                               "busy_training": training, "overrides": self.overrides()}


def split_errors(cfg: Config, rollout_gpus: int, training_gpus: int) -> list[str]:
    """Why a rollout set of `rollout_gpus` beside a training set of `training_gpus` is not a
    valid layout ([] when it is): config/validate.py's layout and batch rules for the two sets."""
    p, a, r, d = cfg.parallel, cfg.actor, cfg.rollout, cfg.data
    model = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    tp, tp_g = p.tensor_model_parallel_size, r.tensor_parallel_size
    errs = []
    if rollout_gpus < tp_g or rollout_gpus % tp_g:
        errs.append(f"{rollout_gpus} rollout GPUs are not replicas of TP_g={tp_g}")
    elif d.train_batch_size % (rollout_gpus // tp_g):
        errs.append(f"{d.train_batch_size} prompts do not split over {rollout_gpus // tp_g} "
                    "generation groups")
    if max(tp, tp_g) % min(tp, tp_g):
        errs.append(f"TP={tp} and TP_g={tp_g}: one must divide the other")
    if training_gpus < model or training_gpus % model:
        errs.append(f"{training_gpus} training GPUs do not hold TP×PP×CP = {model}")
        return errs
    dp, mini = training_gpus // model, a.ppo_mini_batch_size * r.n
    if mini % dp:
        errs.append(f"a mini-batch of {mini} samples does not split over DP={dp}")
    elif padded_micro_batches(a) and (mini // dp) % a.micro_batch_size_per_gpu:
        errs.append(f"{mini // dp} samples per rank are not micro-batches of "
                    f"{a.micro_batch_size_per_gpu}")
    return errs


def _training_memory(cfg: Config, dims: ModelDims, gpus: int, knobs: Knobs,
                     with_generate: bool) -> tuple[bool, int]:
    """(fits?, bytes offloaded per GPU) of the training phases on `gpus` GPUs (and of generation
    on them, colocated), offloading as trainer.offload_between_phases says ("auto": only when a
    phase does not fit otherwise, memory.choose_offload's rule)."""
    setting = cfg.trainer.offload_between_phases
    tries = [False, True] if setting == "auto" else [bool(setting)]
    for offload in tries:
        memory = plan_memory(cfg, dims, gpus, replace(knobs, offload=offload))
        if not with_generate:
            memory.pop("generate", None)
        if not misfits(memory, knobs):
            return True, sum(memory["host"]["per_gpu"].values()) if offload else 0
    return False, 0


def _rollout_memory_fits(cfg: Config, dims: ModelDims, gpus: int, knobs: Knobs) -> bool:
    """The rollout set's generation phase: its own weight copy, KV cache, engine overhead."""
    total = sum(generation_bytes(cfg, dims, gpus, knobs, own_set=True).values())
    return total + RUNTIME_OVERHEAD_GIB * GiB <= knobs.gpu_memory_gib * USABLE_FRACTION * GiB


def splits(cfg: Config, dims: ModelDims, world: int, knobs: Knobs, hw: Hardware,
           response_fraction: float = 1.0) -> list[Split]:
    """The colocated layout, then every valid rollout set (sync and one_step_off), in order of
    rollout GPUs. `response_fraction` also shortens the training sequences to match."""
    d = cfg.data
    length_fraction = ((d.max_prompt_length + d.max_response_length * response_fraction)
                       / (d.max_prompt_length + d.max_response_length))
    # Each layout with the token budgets the trainer would choose on its training GPUs.
    colocated = choose_token_budgets(cfg, dims, world, knobs)[0]
    fits, offloaded = _training_memory(colocated, dims, world, knobs, with_generate=True)
    out = [Split(0, world, "sync", generation_seconds(cfg, dims, world, hw, response_fraction),
                 training_seconds(colocated, dims, world, hw, length_fraction),
                 2 * offloaded / hw.host_copy_bytes_per_s, 0.0, "" if fits else "colocated")]
    tp_g = cfg.rollout.tensor_parallel_size
    for r in range(tp_g, world, tp_g):
        t = world - r
        if split_errors(cfg, r, t):
            continue
        gen = generation_seconds(cfg, dims, r, hw, response_fraction)
        trained = choose_token_budgets(cfg, dims, t, knobs)[0]
        fits, offloaded = _training_memory(trained, dims, t, knobs, with_generate=False)
        sets = {"training set": fits, "rollout set": _rollout_memory_fits(cfg, dims, r, knobs)}
        misfit = " and ".join(name for name, ok in sets.items() if not ok)
        xfer = transfer_seconds(cfg, dims, r, t, hw, one_node=world <= knobs.gpus_per_node)
        offload = 2 * offloaded / hw.host_copy_bytes_per_s
        for mode in ("sync", "one_step_off"):
            train = training_seconds(trained, dims, t, hw, length_fraction,
                                     stale=mode == "one_step_off")
            out.append(Split(r, t, mode, gen, train, offload, xfer, misfit))
    return out


def recommend(candidates: list[Split], stale_ok: bool = True) -> Optional[Split]:
    """The fastest layout that fits (None if none does); stale_ok=False: sync layouts only."""
    ok = [s for s in candidates if s.fits and (stale_ok or s.mode == "sync")]
    return min(ok, key=lambda s: s.step_s) if ok else None


def not_modelled(cfg: Config) -> Optional[str]:
    """Why the split model does not apply to this config (None: it does): a CPU run, or roles
    other than the actor on ranks of their own (the model puts every trained role on the
    training set)."""
    if cfg.trainer.device == "cpu":
        return "trainer.device=cpu (the rates are GPU rates)"
    placed = [role for role in ("reference", "critic", "reward_model")
              if getattr(cfg.placement, role, None) is not None]
    if placed:
        return (f"placement.{', placement.'.join(placed)} puts roles on ranks of their own; the "
                "model puts every trained role on the training set")
    return None


def split_report(cfg: Config, candidates: list[Split], hw: Hardware, response_fraction: float,
                 shown: int = 5) -> str:
    """The planner's section: the fastest layouts that fit (and the colocated one), the
    recommendation with the lines that select it, and what the model leaves out."""
    lines = [f"Rollout / training split (modelled by verl_mcore/plan_time.py, {hw.name}: copy "
             f"{hw.copy_bytes_per_s / 1e12:.2f} TB/s, matmul {hw.matmul_flops_per_s / 1e12:.0f} "
             f"TFLOP/s; training at {hw.train_efficiency:.0%} and generation at "
             f"{hw.rollout_efficiency:.0%} of those bounds; responses "
             f"{response_fraction:.0%} of data.max_response_length long):"]
    colocated = candidates[0]
    rows = sorted((s for s in candidates if s.fits), key=lambda s: s.step_s)[:shown]
    if colocated not in rows:
        rows.append(colocated)
    lines.append(f"  {'layout':<40}{'gen s':>8}{'train s':>9}{'offload s':>11}{'xfer s':>8}"
                 f"{'step s':>9}  busy gen / train")
    for s in rows:
        busy = "-" if s.colocated else f"{s.busy()[0]:.0%} / {s.busy()[1]:.0%}"
        xfer = "-" if s.colocated else f"{s.transfer_s:.3g}"
        lines.append(f"  {s.name():<40}{s.generate_s:8.3g}{s.train_s:9.3g}{s.offload_s:11.3g}"
                     f"{xfer:>8}{s.step_s:9.3g}  {busy}"
                     + ("" if s.fits else "  DOES NOT FIT"))
    unfit = [f"rollout {s.rollout_gpus} + training {s.training_gpus} (its {s.misfit})"
             for s in candidates if not s.fits and not s.colocated and s.mode == "sync"]
    if unfit:
        lines.append("  left out, a set does not fit the GPU: " + "; ".join(unfit))
    if len(candidates) == 1:
        lines.append(f"  no rollout set of its own is possible: it needs a multiple of "
                     f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} GPUs beside "
                     "a training set that holds the actor's TP×PP×CP and splits its batches")
    best = recommend(candidates)
    if best is None:
        lines.append("  no layout fits the GPU (see the memory report)")
    else:
        gain = (f" against {colocated.step_s:.3g} colocated ({colocated.step_s / best.step_s:.2f}x)"
                if not best.colocated and colocated.fits else "")
        lines.append(f"  recommended: {best.name()}, {best.step_s:.3g} s per step{gain}")
        lines.append(f"    {best.overrides()}")
        apart = recommend([s for s in candidates if not s.colocated])
        if best.colocated and apart is not None:
            lines.append(f"  fastest with a rollout set of its own: {apart.name()}, "
                         f"{apart.step_s:.3g} s ({apart.step_s / best.step_s:.2f}x the step)")
            lines.append(f"    {apart.overrides()}")
        on_policy = recommend(candidates, stale_ok=False)
        if best.mode == "one_step_off" and on_policy is not None:
            lines.append(f"  fastest on-policy (sync): {on_policy.name()}, {on_policy.step_s:.3g} s")
    if any(s.mode == "one_step_off" for s in rows):
        lines.append("  one_step_off trains on samples of the policy one update old (staleness 1): "
                     "generation of batch t+1 overlaps the update on batch t")
    lines.append("  a model, not a measurement: TP/DP communication, the repartition, rewards and "
                 "uneven lengths are left out (plan_time.py's docstring lists all)")
    return "\n".join(lines)
