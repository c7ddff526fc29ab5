"""Checks run before any model is built. Each message names the key to change.

Two kinds: the range of every numeric field on its own (`RANGES`, one table: a new numeric field
without an entry fails tests/hostile/test_validation.py), then the cross-field rules (divisibility,
batch sizes, lengths against the model). The cross-field rules run only once every value is in
range, so they never divide by a zero batch size or compare against a NaN.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from verl_mcore.config.loading import ConfigError
from verl_mcore.config.placement import Placement, placement_errors
from verl_mcore.config.schema import Config, padded_micro_batches
from verl_mcore.models.hub import is_hub_id, load_config_json
from verl_mcore.models.lora_targets import HEAD, resolve_targets

# trainer.val_metrics' built-in names -> (module to import, pip package): what each needs
# (val_metrics.py computes them).
BUILTIN_VAL_METRICS = {"exact_match": (None, None), "rouge": ("rouge_score", "rouge-score"),
                       "bleu": ("sacrebleu", "sacrebleu")}

# Every numeric config field: its valid interval (inf is never included: every value must be a
# finite number) and what its edge values mean. `name[]` stands for each item of a list.
_OPTIM = {
    "lr": ("[0, inf)", ""),
    "min_lr": ("[0, inf)", "at most lr"),
    "weight_decay": ("[0, inf)", ""),
    "adam_beta1": ("[0, 1)", ""),
    "adam_beta2": ("[0, 1)", ""),
    "adam_eps": ("(0, inf)", ""),
    "clip_grad": ("[0, inf)", "0: no clipping"),
    "lr_warmup_steps": ("[0, inf)", ""),
}
RANGES: dict[str, tuple[str, str]] = {
    "model.make_vocab_size_divisible_by": ("[1, inf)", ""),
    "parallel.tensor_model_parallel_size": ("[1, inf)", ""),
    "parallel.pipeline_model_parallel_size": ("[1, inf)", ""),
    "parallel.virtual_pipeline_model_parallel_size": ("[1, inf)", "null: no virtual stages"),
    "parallel.context_parallel_size": ("[1, inf)", ""),
    "parallel.expert_model_parallel_size": ("[1, inf)", ""),
    "parallel.moe_aux_loss_coeff": ("[0, inf)", "null: the model's own"),
    "rollout.tensor_parallel_size": ("[1, inf)", ""),
    **{f"placement.{role}.{k}": ("[1, inf)", "null: parallel.*'s")
       for role in ("actor", "reference", "critic", "reward_model", "rollout")
       for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")},
    "rollout.n": ("[1, inf)", ""),
    "rollout.temperature": ("[0, inf)", "0: greedy"),
    "rollout.top_p": ("(0, 1]", "1: off"),
    "rollout.top_k": ("[-1, inf)", "-1 or 0: off"),
    "rollout.seed": ("[0, inf)", "null: derived from trainer.seed"),
    "rollout.gpu_memory_utilization": ("(0, 1]", ""),
    "rollout.max_num_seqs": ("[1, inf)", ""),
    "rollout.max_staleness": ("[1, inf)", "rollout.mode=one_step_off: batches sampled ahead; "
                              "fully_async: versions a trained token may lag"),
    "rollout.tis_cap": ("(0, inf)", "null: no importance weights"),
    "rollout.partial.over_sampling": ("[0, inf)", "extra prompt groups in flight, a share of the batch"),
    "rollout.partial.max_staleness": ("[0, inf)", "policy versions a trained token may lag"),
    "rollout.correction.token_mask": ("(1, inf)", "tokens kept within [1/k, k]; null: off"),
    "rollout.correction.seq_mask": ("(1, inf)", "samples kept within [1/k, k]; null: off"),
    "rollout.correction.decoupled_cap": ("(0, inf)", "null: no cap"),
    "rollout.logprob_check.num_sequences": ("[1, inf)", ""),
    "rollout.logprob_check.max_new_tokens": ("[0, inf)", "0: the rollout's length"),
    "rollout.logprob_check.max_abs_diff": ("[0, inf)", "null: 0.5 for an fp32 actor, 2.0 for bf16 / fp16; "
                                             "+ 3.0 with rollout.dtype=fp8"),
    "rollout.group_filter.import_timeout_s": ("(0, inf)", "seconds"),
    "rollout.generate_fn.import_timeout_s": ("(0, inf)", "seconds"),
    "rollout.agent_loop.import_timeout_s": ("(0, inf)", "seconds"),
    "rollout.agent_loop.max_turns": ("[1, inf)", "model turns per trajectory"),
    "rollout.agent_loop.max_observation_tokens": ("[1, inf)", "one observation turn's tokens"),
    "rollout.agent_loop.tools[].import_timeout_s": ("(0, inf)", "seconds"),
    "rollout.agent_loop.environment.import_timeout_s": ("(0, inf)", "seconds"),
    "rollout.agent_loop.parser.import_timeout_s": ("(0, inf)", "seconds"),
    "rollout.agent_loop.sandbox.num_workers": ("[1, inf)", "tool calls at once"),
    "rollout.agent_loop.sandbox.timeout_s": ("(0, inf)", "seconds per call or environment step"),
    "rollout.agent_loop.sandbox.max_memory_mb": ("[1, inf)", "null: no cap"),
    "rollout.agent_loop.sandbox.max_output_chars": ("[1, inf)", "a result's characters"),
    "rollout.agent_loop.sandbox.startup_timeout_s": ("(0, inf)", "seconds"),
    "rollout.val_n": ("[1, inf)", ""),
    "rollout.val_temperature": ("[0, inf)", "0: greedy"),
    "data.max_prompt_length": ("[1, inf)", ""),
    "data.max_response_length": ("[1, inf)", ""),
    "data.train_batch_size": ("[1, inf)", ""),
    "data.val_batch_size": ("[1, inf)", "null: all validation prompts in one batch"),
    "data.seed": ("[0, inf)", "null: derived from trainer.seed"),
    "data.import_timeout_s": ("(0, inf)", "seconds"),
    "data.read_timeout_s": ("(0, inf)", "seconds; null: 3/4 of trainer.collective_timeout_s"),
    "reward.sources[].weight": ("(-inf, inf)", "negative: a penalty"),
    "reward.sources[].micro_batch_size": ("[1, inf)", "null: the actor's"),
    "reward.sources[].max_tokens_per_microbatch": ("[1, inf)", "null: the actor's"),
    "reward.num_workers": ("[0, inf)", "0: score in the trainer process"),
    "reward.timeout_s": ("(0, inf)", "seconds per sample; there is no 'off'"),
    "reward.fallback_score": ("(-inf, inf)", ""),
    "reward.import_timeout_s": ("(0, inf)", "seconds"),
    "reward.max_memory_mb": ("[64, inf)", "MiB; null: no cap"),
    "reward.max_failed_fraction": ("[0, 1]", "1: never stop"),
    "reward.overlong_buffer.len": ("[1, inf)", "tokens, below data.max_response_length; "
                                                "null: unset"),
    "reward.overlong_buffer.penalty_factor": ("[0, inf)", "0: no penalty"),
    "algorithm.gamma": ("[0, 1]", ""),
    "algorithm.lam": ("[0, 1]", ""),
    "algorithm.kl_ctrl.kl_coef": ("[0, inf)", ""),
    "algorithm.kl_ctrl.target_kl": ("(0, inf)", ""),
    "algorithm.kl_ctrl.horizon": ("[1, inf)", ""),
    "algorithm.filter_groups.max_num_gen_batches": ("[0, inf)", "0: no limit"),
    "actor.ppo_mini_batch_size": ("[1, inf)", ""),
    "actor.micro_batch_size_per_gpu": ("[1, inf)", "null: token-budget micro-batches"),
    "actor.max_tokens_per_microbatch": ("[1, inf)", "null: micro_batch_size_per_gpu if set, else "
                                                      "the planner's budget"),
    "actor.ppo_epochs": ("[1, inf)", ""),
    "actor.clip_ratio_low": ("[0, 1)", ""),
    "actor.clip_ratio_high": ("[0, inf)", ""),
    "actor.clip_ratio_c": ("(1, inf)", "the dual-clip bound"),
    "actor.entropy_coeff": ("(-inf, inf)", "0: off"),
    "actor.kl_loss_coef": ("[0, inf)", ""),
    **{f"actor.optim.{k}": v for k, v in _OPTIM.items()},
    "critic.ppo_mini_batch_size": ("[1, inf)", "null: the actor's"),
    "critic.micro_batch_size_per_gpu": ("[1, inf)", "null: token-budget micro-batches"),
    "critic.max_tokens_per_microbatch": ("[1, inf)", "null: micro_batch_size_per_gpu if set, else "
                                                      "the planner's budget"),
    "critic.ppo_epochs": ("[1, inf)", "null: the actor's"),
    "critic.cliprange_value": ("[0, inf)", ""),
    "critic.warmup_steps": ("[0, inf)", ""),
    **{f"critic.optim.{k}": v for k, v in _OPTIM.items()},
    **{f"{role}.lora.{k}": v for role in ("actor", "critic") for k, v in {
        "r": ("[1, inf)", "the adapters' rank"),
        "alpha": ("(0, inf)", "the adapters' output is scaled by alpha / r"),
        "dropout": ("[0, 1)", ""),
        "lr": ("(0, inf)", "null: the role's optim.lr"),
    }.items()},
    "checkpoint.save_every": ("[0, inf)", "0: only at the end and on preemption"),
    "checkpoint.keep_last": ("[0, inf)", "0: keep every checkpoint"),
    "trainer.total_steps": ("[1, inf)", ""),
    "trainer.max_consecutive_skips": ("[1, inf)", ""),
    "trainer.val_every": ("[0, inf)", "0: no validation"),
    "trainer.val_metric_fn.import_timeout_s": ("(0, inf)", "seconds"),
    "trainer.val_metric_fn.timeout_s": ("(0, inf)", ""),
    "trainer.val_pass_threshold": ("(-inf, inf)", "a score; pass@n counts best >= it"),
    "trainer.log_val_generations": ("[0, inf)", "0: no generations file"),
    "trainer.seed": ("[0, 4294967295]", "torch, numpy and Python generators take it"),
    "trainer.collective_timeout_s": ("(0, inf)", "seconds"),
}


@dataclass(frozen=True)
class _Interval:
    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text: str) -> "_Interval":
        low, high = (float(v) for v in text[1:-1].split(","))
        return cls(low, high, text[0] == "[", text[-1] == "]")

    def __contains__(self, v: float) -> bool:
        return (math.isfinite(v) and (self.low <= v if self.low_closed else self.low < v)
                and (v <= self.high if self.high_closed else v < self.high))

    def __str__(self) -> str:
        if math.isinf(self.low) and math.isinf(self.high):
            return "a finite number"
        if math.isinf(self.high):
            return f"{'>=' if self.low_closed else '>'} {self.low:g}"
        return (f"in {'[' if self.low_closed else '('}{self.low:g}, {self.high:g}"
                f"{']' if self.high_closed else ')'}")


_INTERVALS = {key: _Interval.parse(text) for key, (text, _) in RANGES.items()}


def numeric_fields(cls: type = Config, prefix: str = "") -> Iterator[str]:
    """The RANGES key of every int / float field of the schema (Optional ones included)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], prefix + f.name
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
            yield from numeric_fields(args[0], key + "[].")
            continue
        if typing.get_origin(tp) is typing.Union and len(args) == 1:
            tp = args[0]  # Optional[X]
        elif typing.get_origin(tp) is typing.Union:  # e.g. placement's RoleSetConfig | list | str
            tp = next((a for a in args if dataclasses.is_dataclass(a)), tp)
        if dataclasses.is_dataclass(tp):
            yield from numeric_fields(tp, key + ".")
        elif tp in (int, float):
            yield key


def _values(obj: Any, prefix: str = "", table: str = "") -> Iterator[tuple[str, str, Any]]:
    """(key as the user writes it, RANGES key, value) of every field under `obj`."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _values(value, f"{prefix}{f.name}.", f"{table}{f.name}.")
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                yield from _values(item, f"{prefix}{f.name}[{i}].", f"{table}{f.name}[].")
        else:
            yield prefix + f.name, table + f.name, value


def range_errors(cfg: Config) -> list[str]:
    """One message per numeric field outside its RANGES interval (NaN and inf included)."""
    errs = []
    for key, table_key, value in _values(cfg):
        interval = _INTERVALS.get(table_key)
        if interval is None or value is None or value in interval:
            continue
        note = RANGES[table_key][1]
        finite = "" if math.isfinite(value) else " is not a finite number: it"
        errs.append(f"{key}={value}{finite} must be {interval}" + (f" ({note})" if note else ""))
    return errs


@dataclass(frozen=True)
class ModelShape:
    """The few model dimensions the layout checks need (read from an HF config.json)."""

    num_attention_heads: int
    num_key_value_heads: int
    num_layers: int
    vocab_size: int
    hidden_size: int
    max_position_embeddings: Optional[int] = None  # None: not in config.json, not checked
    tie_word_embeddings: Optional[bool] = None  # None: not in config.json, not checked
    num_experts: Optional[int] = None  # routed experts of a MoE model; None: a dense model

    @classmethod
    def from_hf_dir(cls, path: str) -> Optional["ModelShape"]:
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            return None  # a hub id, or a checkpoint-only run: checked when the model is built
        hf = load_config_json(cfg_file)

        def positive(name: str, required: bool = True) -> Optional[int]:
            v = hf.get(name)
            if v is None and required:
                raise ConfigError(f"{cfg_file}: missing field {name} (model.path)")
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{cfg_file}: {name}={v!r} must be a positive integer (model.path)")
            return v

        heads = positive("num_attention_heads")
        return cls(num_attention_heads=heads,
                   num_key_value_heads=positive("num_key_value_heads", required=False) or heads,
                   num_layers=positive("num_hidden_layers"), vocab_size=positive("vocab_size"),
                   hidden_size=positive("hidden_size"),
                   max_position_embeddings=positive("max_position_embeddings", required=False),
                   tie_word_embeddings=(bool(hf["tie_word_embeddings"])
                                        if "tie_word_embeddings" in hf else None),
                   # qwen*_moe say num_experts (transformers 5 writes num_local_experts), mixtral
                   # num_local_experts
                   num_experts=hf.get("num_experts") or hf.get("num_local_experts") or None)


def data_parallel_size(cfg: Config, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                           * p.context_parallel_size)


def validate(cfg: Config, world_size: int, shape: Optional[ModelShape] = None,
             gpus_per_node: Optional[int] = None, *, data_files: bool = True,
             lengths: bool = True, batches: bool = True) -> None:
    """Raise ConfigError listing every problem of this config for this world size and model.
    The config alone: the files it names (model, data, reward code) are read and checked by
    build.build_inputs, which calls this first. With placement.*, the layout and batch rules
    apply to each role inside its own set of ranks.

    The Python API (verl_mcore/api) has no data files (prompts come with each call), and its
    objects set the lengths and batch sizes at different times: it checks with
    data_files=False, leaving out the data.* lengths until a RolloutWorker sets them and the
    batch rules until an update has its batch."""
    # The cross-field rules assume values in range (no zero divisors, no NaN).
    errors = range_errors(cfg)
    if not errors:
        errors = placement_errors(cfg, world_size, gpus_per_node)
    if not errors:
        sets = Placement.resolve(cfg, world_size, gpus_per_node).sets
        actor_world = len(sets["actor"].ranks)
        # The generation replicas: the rollout set's (placement.rollout), else the actor's.
        gen_world = len(sets["rollout"].ranks) if "rollout" in sets else actor_world
        errors = _layout_errors(cfg, actor_world, shape, gen_world) + _role_layout_errors(sets, shape)
        errors += _batch_errors(cfg, actor_world, sets.get("critic"), gen_world) if batches else []
        errors += _rollout_mode_errors(cfg) + _filter_groups_errors(cfg)
        errors += _length_errors(cfg, shape, data_files, lengths) + _optim_errors(cfg)
        errors += _validation_errors(cfg) + _reward_errors(cfg) + _dependency_errors(cfg)
        errors += _lora_errors(cfg, sets, shape) + _router_replay_errors(cfg)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def _layout_errors(cfg: Config, world: int, shape: Optional[ModelShape],
                   gen_world: Optional[int] = None) -> list[str]:
    """`world`: the actor's ranks; `gen_world`: the generation replicas' (None: the actor's)."""
    p, errs = cfg.parallel, []
    gen_world = world if gen_world is None else gen_world
    own_set = cfg.placement.rollout is not None
    tp, pp, cp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size, p.expert_model_parallel_size)
    tp_g = cfg.rollout.tensor_parallel_size
    if world % (tp * pp * cp) != 0:
        errs.append(
            f"world size {world} is not divisible by TP×PP×CP = {tp}×{pp}×{cp} = {tp * pp * cp}: "
            "change parallel.tensor_model_parallel_size / pipeline_model_parallel_size / "
            "context_parallel_size or the number of ranks")
    elif ep > 1 and (world // (tp * pp * cp)) % ep != 0:
        errs.append(f"data-parallel size {world // (tp * pp * cp)} is not divisible by "
                    f"parallel.expert_model_parallel_size={ep}")
    if own_set and max(tp, tp_g) % min(tp, tp_g):
        errs.append(f"rollout.tensor_parallel_size={tp_g} and parallel.tensor_model_parallel_size"
                    f"={tp}: one must divide the other (the rollout set's shards nest in the "
                    "actor's)")
    elif not own_set and tp % tp_g != 0:
        errs.append(f"rollout.tensor_parallel_size={tp_g} must divide "
                    f"parallel.tensor_model_parallel_size={tp} (generation TP re-slices training TP)")
    if not own_set and gen_world % tp_g != 0:  # placement.rollout's own size: placement.py
        errs.append(f"world size {world} is not divisible by rollout.tensor_parallel_size={tp_g}")
    vpp = p.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1 and pp == 1:
        errs.append("parallel.virtual_pipeline_model_parallel_size needs "
                    "parallel.pipeline_model_parallel_size > 1")
    if p.sequence_parallel and tp == 1:
        errs.append("parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1")
    if p.sequence_parallel and importlib.util.find_spec("transformer_engine") is None:
        # megatron-core's torch-norm fallback (no TE, no apex) asserts sequence_parallel is off.
        errs.append("parallel.sequence_parallel=true needs TransformerEngine "
                    "(pip install transformer-engine[pytorch]) or set it to false")
    if shape is not None:
        for tp_name, t in [("parallel.tensor_model_parallel_size", tp),
                           ("rollout.tensor_parallel_size", tp_g)]:
            if shape.num_attention_heads % t:
                errs.append(f"model has {shape.num_attention_heads} attention heads, not divisible "
                            f"by {tp_name}={t}")
            if shape.num_key_value_heads % t and t % shape.num_key_value_heads:
                errs.append(f"model has {shape.num_key_value_heads} KV heads: {tp_name}={t} must "
                            "divide it (or be a multiple of it)")
        errs += _expert_errors(cfg, shape)
        chunks = pp * (vpp or 1)
        if shape.num_layers % chunks:
            errs.append(f"model has {shape.num_layers} layers, not divisible by PP×VPP = {chunks}: "
                        "change parallel.pipeline_model_parallel_size or "
                        "parallel.virtual_pipeline_model_parallel_size")
    return errs


def _expert_errors(cfg: Config, shape: ModelShape) -> list[str]:
    """Expert parallelism fits the model: a MoE model whose expert count it divides, and no
    tensor parallelism beside it (megatron-core's MoE layer needs sequence parallelism with TP
    in training, which needs TransformerEngine's norms)."""
    p, errs = cfg.parallel, []
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    if ep > 1 and shape.num_experts is None:
        errs.append(f"parallel.expert_model_parallel_size={ep} needs a mixture-of-experts model "
                    f"(model.path {cfg.model.path} has no num_experts / num_local_experts)")
    elif ep > 1 and shape.num_experts % ep:
        errs.append(f"parallel.expert_model_parallel_size={ep} must divide the model's "
                    f"{shape.num_experts} experts")
    if shape.num_experts is not None and tp > 1 and not p.sequence_parallel:
        errs.append(f"a mixture-of-experts model at parallel.tensor_model_parallel_size={tp} "
                    "trains only with parallel.sequence_parallel=true (megatron-core's MoE layer), "
                    "which needs TransformerEngine: set tensor_model_parallel_size=1 and use "
                    "parallel.expert_model_parallel_size instead")
    if p.moe_aux_loss_coeff is not None and shape.num_experts is None:
        errs.append(f"parallel.moe_aux_loss_coeff={p.moe_aux_loss_coeff} is for "
                    "mixture-of-experts models; model.path is dense: leave it null")
    if cfg.actor.router_replay != "off" and shape.num_experts is None:
        errs.append(f"actor.router_replay={cfg.actor.router_replay} replays a mixture-of-experts "
                    f"model's routing; model.path {cfg.model.path} is dense: set "
                    "actor.router_replay=off")
    return errs


def _router_replay_errors(cfg: Config) -> list[str]:
    """actor.router_replay=rollout against what the replay (models/router_replay.py) and the
    engine's recording (rollout/native.py) handle."""
    a, r, p = cfg.actor, cfg.rollout, cfg.parallel
    if a.router_replay == "off":
        return []
    why = f"actor.router_replay={a.router_replay} "
    conflicts = [
        (a.recompute_activations, "actor.recompute_activations=true (the recomputed forward "
                                  "would route with the next micro-batch's experts)"),
        (p.context_parallel_size > 1, f"parallel.context_parallel_size={p.context_parallel_size} "
                                      "(a router sees a slice of each sequence)"),
        (p.sequence_parallel, "parallel.sequence_parallel=true (a router sees a slice of the "
                              "tokens)"),
        (r.engine != "native", f"rollout.engine={r.engine} (only the native engine records the "
                               "experts it routed to)"),
    ]
    return [why + "cannot run with " + what + ": turn one of them off"
            for bad, what in conflicts if bad]


def rollout_batch_bytes(cfg: Config) -> int:
    """The step's global rollout batch, held by every rank after generation (engine/batch.py):
    input_ids int64 [B, prompt + response] and 7 float32 [B, response] fields (mask, old and
    reference log-probs, values, token rewards, advantages, returns). The memory planner counts
    it in every phase after generation (planning/memory.py)."""
    d = cfg.data
    samples = d.train_batch_size * cfg.rollout.n
    return samples * (8 * (d.max_prompt_length + d.max_response_length) + 7 * 4 * d.max_response_length)


def _rollout_batch_fits(cfg: Config) -> list[str]:
    """The step's rollout batch (train_batch_size x rollout.n samples at the longest lengths) is
    held whole in host memory by every rank: one copy larger than this machine's memory would
    otherwise be a MemoryError in step 1, after the models were built."""
    GiB = 1024 ** 3
    need = rollout_batch_bytes(cfg)
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return []
    if need <= have:
        return []
    d = cfg.data
    return [f"the step's rollout batch, data.train_batch_size={d.train_batch_size} x rollout.n="
            f"{cfg.rollout.n} samples of up to {d.max_prompt_length} + {d.max_response_length} "
            f"tokens, needs {need / GiB:.1f} GiB on every rank, more than this machine's "
            f"{have / GiB:.1f} GiB: lower them"]


def _role_layout_errors(sets: dict, shape: Optional[ModelShape]) -> list[str]:
    """The model's shape against the layouts placement.* gives roles other than the actor."""
    errs = []
    for role, s in sets.items():
        if role == "actor" or shape is None:
            continue
        if shape.num_attention_heads % s.tp or (shape.num_key_value_heads % s.tp
                                                and s.tp % shape.num_key_value_heads):
            errs.append(f"placement.{role}.tensor_model_parallel_size={s.tp} does not divide the "
                        f"model's {shape.num_attention_heads} attention / "
                        f"{shape.num_key_value_heads} KV heads")
        if shape.num_layers % (s.pp * (s.vpp or 1)):
            errs.append(f"placement.{role}.pipeline_model_parallel_size={s.pp} does not divide the "
                        f"model's {shape.num_layers} layers")
    return errs


def _batch_errors(cfg: Config, world: int, critic_set=None,
                  gen_world: Optional[int] = None) -> list[str]:
    """`world`: the actor's ranks; `critic_set`: the critic's RoleSet (placement); `gen_world`:
    the generation replicas' ranks (None: the actor's)."""
    errs = []
    gen_world = world if gen_world is None else gen_world
    d, a, r = cfg.data, cfg.actor, cfg.rollout
    if world % max(1, cfg.parallel.tensor_model_parallel_size
                           * cfg.parallel.pipeline_model_parallel_size
                           * cfg.parallel.context_parallel_size):
        return errs
    dp = data_parallel_size(cfg, world)
    tp_g = cfg.rollout.tensor_parallel_size
    dp_g = gen_world // tp_g if gen_world % tp_g == 0 else None
    errs += _rollout_batch_fits(cfg)
    if d.train_batch_size % a.ppo_mini_batch_size:
        errs.append(f"data.train_batch_size={d.train_batch_size} is not divisible by "
                    f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}")
    mini_samples = a.ppo_mini_batch_size * r.n
    if mini_samples % dp:
        errs.append(f"a mini-batch of actor.ppo_mini_batch_size×rollout.n = {mini_samples} samples "
                    f"does not split over data-parallel size {dp}")
    elif padded_micro_batches(a) and (mini_samples // dp) % a.micro_batch_size_per_gpu:
        errs.append(f"per-rank mini-batch of {mini_samples // dp} samples is not divisible by "
                    f"actor.micro_batch_size_per_gpu={a.micro_batch_size_per_gpu} (or set "
                    "actor.max_tokens_per_microbatch for token-budget micro-batches)")
    if dp_g and d.train_batch_size % dp_g:
        where = ("placement.rollout's ranks" if cfg.placement.rollout is not None else "world")
        errs.append(f"data.train_batch_size={d.train_batch_size} prompts do not split over the "
                    f"{dp_g} generation groups ({where} / rollout.tensor_parallel_size)")
    if cfg.uses_critic:
        c = cfg.critic
        dp = critic_set.dp if critic_set is not None else dp
        c_mini = (c.ppo_mini_batch_size or a.ppo_mini_batch_size)
        if d.train_batch_size % c_mini:
            errs.append(f"data.train_batch_size={d.train_batch_size} is not divisible by "
                        f"critic.ppo_mini_batch_size={c_mini}")
        elif (c_mini * r.n) % dp == 0 and padded_micro_batches(c) \
                and (c_mini * r.n // dp) % c.micro_batch_size_per_gpu:
            errs.append(f"per-rank critic mini-batch of {c_mini * r.n // dp} samples is not "
                        f"divisible by critic.micro_batch_size_per_gpu={c.micro_batch_size_per_gpu}")
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and r.n < 2:
        errs.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares samples of the "
                    f"same prompt: set rollout.n >= 2 (got {r.n})")
    return errs


def _rollout_mode_errors(cfg: Config) -> list[str]:
    """rollout.mode / tis_cap / correction / dtype against the placement, the engine and each
    other."""
    r, errs = cfg.rollout, []
    if r.mode == "one_step_off" and cfg.placement.rollout is None:
        errs.append("rollout.mode=one_step_off overlaps generation with training on GPUs of their "
                    "own: set placement.rollout to the generation ranks (e.g. the last GPUs of "
                    "the job), or use rollout.mode=sync")
    c = r.correction
    if c.decoupled and r.tis_cap is not None:
        errs.append(f"rollout.correction.decoupled=true weighs each token by pi_old / pi_engine "
                    f"itself, and rollout.tis_cap={r.tis_cap} would set the same weights "
                    "truncated: unset rollout.tis_cap (truncated weights, verl's decoupled mode) "
                    "or rollout.correction.decoupled (AReaL's objective; its cap is "
                    "rollout.correction.decoupled_cap)")
    if c.decoupled_cap is not None and not c.decoupled:
        errs.append(f"rollout.correction.decoupled_cap={c.decoupled_cap} caps the weights of "
                    "the decoupled objective, which is off: set rollout.correction.decoupled=true "
                    "or remove decoupled_cap (rollout.tis_cap truncates the weights instead)")
    if r.dtype == "fp8" and r.engine != "native":
        errs.append(f"rollout.dtype=fp8 is the native engine's FP8 generation copy; "
                    f"rollout.engine={r.engine} loads the weights its own way: use "
                    "rollout.engine=native or rollout.dtype=auto")
    if r.weighs_engine_log_probs and r.engine == "vllm" and (r.top_p < 1 or r.top_k > 0) \
            and r.temperature > 0:
        what = "rollout.tis_cap" if r.tis_cap is not None else "rollout.correction"
        errs.append(f"{what} weighs tokens by the engine's log-probs, which vLLM gives for the "
                    f"top-p / top-k truncated distribution (rollout.top_p={r.top_p}, "
                    f"rollout.top_k={r.top_k}), not the model's: set rollout.top_p=1 and "
                    f"rollout.top_k=-1, use rollout.engine=native, or turn {what} off")
    errs += _partial_errors(cfg)
    errs += _fully_async_errors(cfg)
    a, g = r.agent_loop, r.generate_fn
    if not a.path and a.name in ("tools", "environment"):  # the built-in loops (agent/builtin.py)
        needs = {"tools": ("tools", bool(a.tools) or bool(a.environment.path)),
                 "environment": ("environment", bool(a.environment.path))}[a.name]
        if not needs[1]:
            errs.append(f"rollout.agent_loop.name={a.name} (built in) runs the configured "
                        f"{needs[0]}: set rollout.agent_loop.{needs[0]}"
                        + (" (a list of {path, name})" if needs[0] == "tools" else
                           " (path, name of the environment class)"))
    elif a.name and not a.path:
        errs.append(f"rollout.agent_loop.name={a.name} without a path is none of the built-in "
                    "loops (tools, environment): give rollout.agent_loop.path, the file of your "
                    "AgentLoop class")
    elif (a.tools or a.environment.path) and not a.path:
        errs.append("rollout.agent_loop.tools / .environment are set but no agent loop runs them: "
                    "set rollout.agent_loop.name to a built-in loop (tools, environment) or to "
                    "your class with rollout.agent_loop.path")
    if a.configured and (g.path or g.name):
        errs.append(f"rollout.agent_loop ({a.path}:{a.name}) and rollout.generate_fn ({g.path}:"
                    f"{g.name}) both sample the batch: keep one (an agent loop's turns can do what "
                    "a generate function's engine calls do)")
    return errs


def _partial_errors(cfg: Config) -> list[str]:
    """rollout.partial.enable against what its producer (partial_rollouts.py) does not do: it
    samples over the native engine's serving session, colocated, one prompt group at a time."""
    r, errs = cfg.rollout, []
    if not r.partial.enable:
        return errs
    why = "rollout.partial.enable=true "
    if r.mode != "sync":
        errs.append(why + f"continues samples across steps itself: set rollout.mode=sync (got "
                    f"{r.mode})")
    placed = [f"placement.{k}" for k in ("actor", "reference", "critic", "reward_model", "rollout")
              if getattr(cfg.placement, k) is not None]
    if placed:
        errs.append(why + f"runs colocated (every role on every rank): unset {', '.join(placed)}")
    return errs + _pool_errors(cfg, why)


def _pool_errors(cfg: Config, why: str) -> list[str]:
    """What a pool of prompt groups in flight across steps (rollout/partial.py: partial
    rollouts, fully_async) cannot follow; `why`: the option that keeps one, as the errors'
    first words."""
    r, errs = cfg.rollout, []
    if r.engine != "native":
        errs.append(why + f"aborts and continues requests on the native engine: set "
                    f"rollout.engine=native (got {r.engine})")
    users = [k for k, c in (("rollout.generate_fn", r.generate_fn), ("rollout.agent_loop", r.agent_loop),
                            ("rollout.group_filter", r.group_filter)) if c.path or c.name]
    if cfg.algorithm.filter_groups.enable:
        users.append("algorithm.filter_groups.enable")
    if users:
        errs.append(why + f"samples prompt groups across steps, which {', '.join(users)} "
                    "cannot follow: turn one of them off")
    if cfg.algorithm.adv_estimator == "remax":
        errs.append(why + "has no greedy baselines to continue: algorithm.adv_estimator=remax "
                    "is not supported with it")
    return errs


def _fully_async_errors(cfg: Config) -> list[str]:
    """rollout.mode=fully_async against what its producer (fully_async.py) does not do: it keeps
    prompt groups in flight on a rollout set of its own, over the native engine's serving
    session, one prompt group at a time (the batch's split over the replicas: _batch_errors)."""
    r, errs = cfg.rollout, []
    if r.mode != "fully_async":
        return errs
    why = "rollout.mode=fully_async "
    if cfg.placement.rollout is None:
        errs.append(why + "generates on GPUs of its own while the actor trains: set "
                    "placement.rollout to the generation ranks (and placement.actor to the "
                    "others)")
    if r.partial.enable:
        errs.append(why + "keeps its own pool of partial rollouts on the rollout set: set "
                    "rollout.partial.enable=false (rollout.partial.over_sampling still sets how "
                    "many groups are in flight; rollout.max_staleness bounds their age)")
    return errs + _pool_errors(cfg, why)


def _filter_groups_errors(cfg: Config) -> list[str]:
    """algorithm.filter_groups settings that could never act (rollout/group_filter.py; the
    metric's existence for the configured reward is checked where the reward is built)."""
    f, errs = cfg.algorithm.filter_groups, []
    user = cfg.rollout.group_filter
    if f.enable and cfg.rollout.n < 2:
        errs.append(f"algorithm.filter_groups.enable=true compares the samples of a prompt, but "
                    f"rollout.n={cfg.rollout.n}: a group of one sample is always kept; set "
                    "rollout.n >= 2 or turn the filter off")
    if f.enable and f.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        errs.append("algorithm.filter_groups.metric=seq_final_reward is the reward after the "
                    "in-reward KL penalty (algorithm.use_kl_in_reward=true), which needs the "
                    "log-prob passes that run after the groups are filtered; use metric=score "
                    "(the same reward without the KL term)")
    filtering = f.enable or user.path or user.name
    # The producer refills a step's batch by sampling, scoring and filtering in turn, every rank
    # alike (rollouts.py): not (yet) ahead of the step, nor on a rollout set of its own, whose
    # ranks do not score; ReMax's greedy baselines are not selected with the groups.
    what = ("algorithm.filter_groups.enable=true" if f.enable else
            "rollout.group_filter")
    if filtering and cfg.rollout.mode != "sync":
        errs.append(f"{what} refills each step's batch as it samples, which rollout.mode="
                    f"{cfg.rollout.mode} does not do yet: use rollout.mode=sync")
    if filtering and cfg.placement.rollout is not None:
        errs.append(f"{what} filters on the training ranks' scores, which a rollout set of its "
                    "own (placement.rollout) does not see yet: leave placement.rollout unset")
    if filtering and cfg.algorithm.adv_estimator == "remax":
        errs.append(f"{what} with algorithm.adv_estimator=remax: the greedy baselines are not "
                    "filtered with their groups; use grpo, rloo or another estimator")
    if filtering and f.on_max_gen_batches == "train" and f.max_num_gen_batches <= 0:
        errs.append(f"algorithm.filter_groups.on_max_gen_batches=train says what a step does "
                    f"after max_num_gen_batches generation batches, but max_num_gen_batches="
                    f"{f.max_num_gen_batches} sets no limit; set max_num_gen_batches > 0 or "
                    "remove on_max_gen_batches")
    return errs


def _length_errors(cfg: Config, shape: Optional[ModelShape], data_files: bool = True,
                   lengths: bool = True) -> list[str]:
    errs = []
    d = cfg.data
    longest = d.max_prompt_length + d.max_response_length
    if lengths and shape is not None and shape.max_position_embeddings \
            and longest > shape.max_position_embeddings:
        errs.append(f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + "
                    f"{d.max_response_length} = {longest} tokens is more than the model's "
                    f"max_position_embeddings={shape.max_position_embeddings} (its config.json): "
                    "lower one of them")
    for role in ("actor", "critic"):
        budget = getattr(cfg, role).max_tokens_per_microbatch
        if lengths and budget is not None and budget < longest:
            errs.append(f"{role}.max_tokens_per_microbatch={budget} is smaller than one full "
                        f"sequence (data.max_prompt_length + data.max_response_length = "
                        f"{d.max_prompt_length + d.max_response_length})")
    if cfg.model.path is None and cfg.model.checkpoint is None:
        errs.append("set model.path (a Hugging Face directory) or model.checkpoint")
    if cfg.model.revision is not None and not is_hub_id(cfg.model.path):
        errs.append(f"model.revision={cfg.model.revision} selects a snapshot of a Hugging Face "
                    f"Hub id, but model.path={cfg.model.path} is not one (a local directory has "
                    "one version); remove model.revision or set model.path to an `org/name` id")
    if data_files and not cfg.data.train_files:
        errs.append("data.train_files is empty: give one or more Parquet/Arrow/JSONL files")
    read, wait = cfg.data.read_timeout_s, cfg.trainer.collective_timeout_s
    if read is not None and read >= wait:
        errs.append(f"data.read_timeout_s={read:g} must be below trainer.collective_timeout_s="
                    f"{wait:g}: the ranks that finished reading the data wait for the others in a "
                    "collective that gives up after that; raise trainer.collective_timeout_s too")
    return errs


def _optim_errors(cfg: Config) -> list[str]:
    errs = []
    for role in ("actor", "critic"):
        o = getattr(cfg, role).optim
        if o.min_lr > o.lr:
            errs.append(f"{role}.optim.min_lr={o.min_lr} is above {role}.optim.lr={o.lr}: the "
                        "schedule decays from lr down to min_lr")
    return errs


def _validation_errors(cfg: Config) -> list[str]:
    """Validation asked for without data (it would silently never run), what only validation
    reads set while it is off (nothing would compute or write it), or a batch of none."""
    t, d, errs = cfg.trainer, cfg.data, []
    asked = t.val_every > 0 or t.val_before_train
    if asked and not d.val_files:
        by = f"trainer.val_every={t.val_every}" if t.val_every > 0 else "trainer.val_before_train=true"
        errs.append(f"{by} but data.val_files is empty: give validation files or turn "
                    "validation off (trainer.val_every=0, trainer.val_before_train=false)")
    fn = t.val_metric_fn
    keys = [  # (key, value, the override that removes it); a value that is set is not the default
        ("trainer.val_metrics", t.val_metrics, "[]"),
        ("trainer.val_metric_kwargs", dict(t.val_metric_kwargs), "{}"),
        ("trainer.val_metric_fn.path", fn.path, "null"),
        ("trainer.val_metric_fn.name", fn.name, "null"),
        ("trainer.log_val_generations", t.log_val_generations, "0")]
    unread = [(key, value, off) for key, value, off in keys if value]
    if unread and not asked:
        files = "" if d.val_files else " and data.val_files is empty"
        errs.append(f"{', '.join(f'{k}={v}' for k, v, _ in unread)} configure validation, which "
                    f"is off (trainer.val_every=0 and trainer.val_before_train=false{files}): "
                    "nothing would compute or write them. Validate (trainer.val_every > 0 or "
                    "trainer.val_before_train=true, with data.val_files), or remove them: "
                    + " ".join(f"{k}={off}" for k, _, off in unread))
    return errs + val_metric_errors(t)


def val_metric_errors(t) -> list[str]:
    """trainer.val_metrics / val_metric_kwargs problems visible from the config and the installed
    packages (a name `evaluate` cannot load is found by val_metrics.ValMetrics.from_config)."""
    errs = []
    has_evaluate = importlib.util.find_spec("evaluate") is not None
    for i, name in enumerate(t.val_metrics):
        key = f"trainer.val_metrics[{i}]={name!r}"
        if name in BUILTIN_VAL_METRICS:
            module, package = BUILTIN_VAL_METRICS[name]
            if module and importlib.util.find_spec(module) is None:
                errs.append(f"{key} needs the {package} package, which is not installed: "
                            f"pip install {package}")
        elif not has_evaluate:
            errs.append(f"{key} is not a built-in metric ({', '.join(BUILTIN_VAL_METRICS)}) and the HF "
                        f"`evaluate` library, which provides other metrics by name, is not "
                        f"installed: pip install evaluate (plus the metric's own packages), or "
                        f"choose a built-in one")
    if len(set(t.val_metrics)) != len(t.val_metrics):
        errs.append(f"trainer.val_metrics={t.val_metrics} names a metric twice")
    for name in t.val_metric_kwargs:
        if name not in t.val_metrics:
            errs.append(f"trainer.val_metric_kwargs.{name}: {name!r} is not in "
                        f"trainer.val_metrics={t.val_metrics}")
        elif name == "exact_match":
            errs.append("trainer.val_metric_kwargs.exact_match: exact_match takes no arguments")
    return errs


def _reward_errors(cfg: Config) -> list[str]:
    r, errs = cfg.reward, []
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    for i, s in enumerate(r.sources):
        if s.type == "environment" and not (cfg.rollout.agent_loop.configured
                                            or cfg.rollout.generate_fn.path):
            errs.append(f"reward.sources[{i}] ({s.name!r}) is an environment reward: it reads the "
                        "reward each trajectory's sampling gave, which only rollout.agent_loop "
                        "(or a rollout.generate_fn setting SampleOutput.reward) gives; set one")
        a = cfg.rollout.agent_loop
        if s.type == "environment" and not a.path and a.name == "tools":  # agent/builtin.py
            errs.append(f"reward.sources[{i}] ({s.name!r}) is an environment reward: it reads the "
                        "reward each trajectory's sampling gave, and the built-in `tools` loop "
                        "gives none (every sample would fail its score); use "
                        "rollout.agent_loop.name=environment, or score with a rule or custom "
                        "source")
        if s.type == "environment" and (s.path or s.function):
            errs.append(f"reward.sources[{i}] ({s.name!r}) is an environment reward: it has no "
                        "path or function (the agent loop's run returns the reward)")
        if s.type == "reward_model" and not s.path:
            errs.append(f"reward.sources[{i}] ({s.name!r}) is a reward_model: set its path (an HF "
                        "*ForSequenceClassification directory or a dist checkpoint)")
        if s.revision is not None and (s.type != "reward_model" or not is_hub_id(s.path)):
            errs.append(f"reward.sources[{i}].revision={s.revision} selects a snapshot of a "
                        f"reward model's Hugging Face Hub id, but its path={s.path} is not one; "
                        "remove the revision or set the path to an `org/name` id")
        if s.type == "reward_model" and s.max_tokens_per_microbatch is not None \
                and s.max_tokens_per_microbatch < longest:
            errs.append(f"reward.sources[{i}].max_tokens_per_microbatch={s.max_tokens_per_microbatch}"
                        f" is smaller than the longest sequence, data.max_prompt_length + "
                        f"data.max_response_length = {longest}")
    ob, longest_response = r.overlong_buffer, cfg.data.max_response_length
    if ob.enable and ob.len is None:
        errs.append("reward.overlong_buffer.enable=true needs reward.overlong_buffer.len: the "
                    "tokens before data.max_response_length over which the penalty grows "
                    f"(DAPO's L_cache), below data.max_response_length={longest_response}")
    elif ob.enable and ob.len >= longest_response:
        errs.append(f"reward.overlong_buffer.len={ob.len} must be below data.max_response_length="
                    f"{longest_response}: the penalty starts after max_response_length - len "
                    "tokens, so every response would be penalised; lower the len or raise the "
                    "data.max_response_length")
    if r.max_memory_mb is not None and r.num_workers == 0:
        errs.append(f"reward.max_memory_mb={r.max_memory_mb} needs reward.num_workers >= 1: the "
                    "cap is set on the scoring worker processes (in the trainer process it would "
                    "cap the trainer); set num_workers or max_memory_mb=null")
    return errs


def _lora_errors(cfg: Config, sets: dict, shape: Optional[ModelShape]) -> list[str]:
    """LoRA settings that could not run: unknown target names, lm_head where the output layer
    is a value head or tied to the embedding, a peft directory that is not one, and, on the
    actor, a reference that is not the actor's own base model."""
    errs = []
    for role in ("actor", "critic"):
        lora = getattr(cfg, role).lora
        if not lora.enable:
            continue
        try:
            targets = resolve_targets(lora.target_modules)
        except ValueError as e:
            errs.append(f"{role}.{e}")
            targets = ()
        if HEAD in targets and role == "critic":
            errs.append("critic.lora.target_modules: lm_head: the critic's output layer is its "
                        "value head, which trains whole; drop lm_head")
        elif HEAD in targets and shape is not None and shape.tie_word_embeddings:
            errs.append(f"{role}.lora.target_modules: lm_head is tied to embed_tokens in this "
                        "model (tie_word_embeddings in its config.json); an adapter on it would "
                        "untie them in the generation weights and the merged export. Drop lm_head")
        if lora.init_from and not os.path.isfile(os.path.join(lora.init_from, "adapter_config.json")):
            errs.append(f"{role}.lora.init_from={lora.init_from!r}: no adapter_config.json there "
                        "(a peft adapter directory, as PeftModel.save_pretrained writes it)")
    if cfg.actor.lora.enable and "reference" in sets and sets["reference"].ranks != sets["actor"].ranks:
        errs.append("placement.reference: with actor.lora.enable the reference is the actor's "
                    "model with its adapters off, so it runs on the actor's GPUs; drop "
                    "placement.reference")
    if cfg.actor.lora.enable and cfg.reference.offload_params:
        errs.append("reference.offload_params: with actor.lora.enable the reference is the "
                    "actor's own model (nothing of its own to offload); set it to false")
    return errs


def _dependency_errors(cfg: Config) -> list[str]:
    """Optional packages a config asks for, checked now rather than after hours in a queue."""
    need = []
    if cfg.rollout.engine == "vllm":
        need.append(("vllm", "rollout.engine=vllm", "pip install vllm (or rollout.engine=native)"))
    if cfg.reward.math_compat == "math_verify":
        need.append(("math_verify", "reward.math_compat=math_verify",
                     "pip install 'verl_mcore[math]' (or math-verify), or reward.math_compat=verl"))
    for tracker, module in [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")]:
        if tracker in cfg.trainer.logger:
            need.append((module.split(".")[0] if tracker == "wandb" else "tensorboard",
                         f"trainer.logger contains {tracker}", f"pip install {tracker}"))
    errs = [f"{why} but {mod} is not installed: {fix}"
            for mod, why, fix in need if importlib.util.find_spec(mod) is None]
    unknown = set(cfg.trainer.logger) - {"console", "jsonl", "tensorboard", "wandb"}
    if unknown:
        errs.append(f"trainer.logger: unknown tracker(s) {sorted(unknown)}; "
                    "choose from console, jsonl, tensorboard, wandb")
    return errs
