"""Cross-field checks, run before any model is built. Each message names the fields to change."""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Optional

from verl_mcore.config.loading import ConfigError
from verl_mcore.config.schema import Config


@dataclass(frozen=True)
class ModelShape:
    """The few model dimensions the layout checks need (read from an HF config.json)."""

    num_attention_heads: int
    num_key_value_heads: int
    num_layers: int
    vocab_size: int
    hidden_size: int

    @classmethod
    def from_hf_dir(cls, path: str) -> Optional["ModelShape"]:
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            return None  # a hub id, or a checkpoint-only run: checked when the model is built
        with open(cfg_file) as f:
            hf = json.load(f)
        try:
            heads = hf["num_attention_heads"]
            return cls(
                num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads") or heads,
                num_layers=hf["num_hidden_layers"],
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
            )
        except KeyError as e:
            raise ConfigError(f"{cfg_file}: missing field {e.args[0]} (model.path)") from None


def data_parallel_size(cfg: Config, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                           * p.context_parallel_size)


def validate(cfg: Config, world_size: int, shape: Optional[ModelShape] = None) -> None:
    """Raise ConfigError listing every cross-field problem for this world size and model."""
    errors = _layout_errors(cfg, world_size, shape) + _batch_errors(cfg, world_size)
    errors += _length_errors(cfg) + _algorithm_errors(cfg) + _validation_errors(cfg)
    errors += _dependency_errors(cfg)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def _layout_errors(cfg: Config, world: int, shape: Optional[ModelShape]) -> list[str]:
    p, errs = cfg.parallel, []
    tp, pp, cp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size, p.expert_model_parallel_size)
    tp_g = cfg.rollout.tensor_parallel_size
    for name, v in [("parallel.tensor_model_parallel_size", tp),
                    ("parallel.pipeline_model_parallel_size", pp),
                    ("parallel.context_parallel_size", cp),
                    ("parallel.expert_model_parallel_size", ep),
                    ("rollout.tensor_parallel_size", tp_g),
                    ("model.make_vocab_size_divisible_by", cfg.model.make_vocab_size_divisible_by)]:
        if v < 1:
            errs.append(f"{name}={v} must be >= 1")
    if errs:
        return errs
    if world % (tp * pp * cp) != 0:
        errs.append(
            f"world size {world} is not divisible by TP×PP×CP = {tp}×{pp}×{cp} = {tp * pp * cp}: "
            "change parallel.tensor_model_parallel_size / pipeline_model_parallel_size / "
            "context_parallel_size or the number of ranks")
    elif ep > 1 and (world // (tp * pp * cp)) % ep != 0:
        errs.append(f"data-parallel size {world // (tp * pp * cp)} is not divisible by "
                    f"parallel.expert_model_parallel_size={ep}")
    if tp % tp_g != 0:
        errs.append(f"rollout.tensor_parallel_size={tp_g} must divide "
                    f"parallel.tensor_model_parallel_size={tp} (generation TP re-slices training TP)")
    if world % tp_g != 0:
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
        chunks = pp * (vpp or 1)
        if shape.num_layers % chunks:
            errs.append(f"model has {shape.num_layers} layers, not divisible by PP×VPP = {chunks}: "
                        "change parallel.pipeline_model_parallel_size or "
                        "parallel.virtual_pipeline_model_parallel_size")
    return errs


def _batch_errors(cfg: Config, world: int) -> list[str]:
    errs = []
    d, a, r = cfg.data, cfg.actor, cfg.rollout
    for name, v in [("data.train_batch_size", d.train_batch_size), ("rollout.n", r.n),
                    ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
                    ("actor.micro_batch_size_per_gpu", a.micro_batch_size_per_gpu),
                    ("actor.ppo_epochs", a.ppo_epochs), ("trainer.total_steps", cfg.trainer.total_steps)]:
        if v < 1:
            errs.append(f"{name}={v} must be >= 1")
    if errs or world % max(1, cfg.parallel.tensor_model_parallel_size
                           * cfg.parallel.pipeline_model_parallel_size
                           * cfg.parallel.context_parallel_size):
        return errs
    dp = data_parallel_size(cfg, world)
    dp_g = world // cfg.rollout.tensor_parallel_size if world % cfg.rollout.tensor_parallel_size == 0 else None
    if d.train_batch_size % a.ppo_mini_batch_size:
        errs.append(f"data.train_batch_size={d.train_batch_size} is not divisible by "
                    f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}")
    mini_samples = a.ppo_mini_batch_size * r.n
    if mini_samples % dp:
        errs.append(f"a mini-batch of actor.ppo_mini_batch_size×rollout.n = {mini_samples} samples "
                    f"does not split over data-parallel size {dp}")
    elif a.max_tokens_per_microbatch is None and (mini_samples // dp) % a.micro_batch_size_per_gpu:
        errs.append(f"per-rank mini-batch of {mini_samples // dp} samples is not divisible by "
                    f"actor.micro_batch_size_per_gpu={a.micro_batch_size_per_gpu} (or set "
                    "actor.max_tokens_per_microbatch for token-budget micro-batches)")
    if dp_g and d.train_batch_size % dp_g:
        errs.append(f"data.train_batch_size={d.train_batch_size} prompts do not split over the "
                    f"{dp_g} generation groups (world / rollout.tensor_parallel_size)")
    if cfg.uses_critic:
        c = cfg.critic
        c_mini = (c.ppo_mini_batch_size or a.ppo_mini_batch_size)
        critic_errs = [f"{name}={v} must be >= 1" for name, v in [
            ("critic.ppo_mini_batch_size", c.ppo_mini_batch_size),
            ("critic.micro_batch_size_per_gpu", c.micro_batch_size_per_gpu),
            ("critic.ppo_epochs", c.ppo_epochs)] if v is not None and v < 1]
        if critic_errs:
            errs += critic_errs
        elif d.train_batch_size % c_mini:
            errs.append(f"data.train_batch_size={d.train_batch_size} is not divisible by "
                        f"critic.ppo_mini_batch_size={c_mini}")
        elif (c_mini * r.n) % dp == 0 and c.max_tokens_per_microbatch is None \
                and (c_mini * r.n // dp) % c.micro_batch_size_per_gpu:
            errs.append(f"per-rank critic mini-batch of {c_mini * r.n // dp} samples is not "
                        f"divisible by critic.micro_batch_size_per_gpu={c.micro_batch_size_per_gpu}")
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and r.n < 2:
        errs.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares samples of the "
                    f"same prompt: set rollout.n >= 2 (got {r.n})")
    return errs


def _length_errors(cfg: Config) -> list[str]:
    errs = []
    d = cfg.data
    for name, v in [("data.max_prompt_length", d.max_prompt_length),
                    ("data.max_response_length", d.max_response_length)]:
        if v < 1:
            errs.append(f"{name}={v} must be positive")
    for role in ("actor", "critic"):
        budget = getattr(cfg, role).max_tokens_per_microbatch
        if budget is not None and budget < d.max_prompt_length + d.max_response_length:
            errs.append(f"{role}.max_tokens_per_microbatch={budget} is smaller than one full "
                        f"sequence (data.max_prompt_length + data.max_response_length = "
                        f"{d.max_prompt_length + d.max_response_length})")
    if not 0 < cfg.rollout.top_p <= 1:
        errs.append(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1]")
    if cfg.rollout.temperature < 0:
        errs.append(f"rollout.temperature={cfg.rollout.temperature} must be >= 0")
    check = cfg.rollout.logprob_check
    if check.max_new_tokens < 0 or check.num_sequences < 1:
        errs.append(f"rollout.logprob_check: max_new_tokens={check.max_new_tokens} must be >= 0 "
                    f"(0: the rollout's length) and num_sequences={check.num_sequences} >= 1")
    if cfg.model.path is None and cfg.model.checkpoint is None:
        errs.append("set model.path (a Hugging Face directory) or model.checkpoint")
    if not cfg.data.train_files:
        errs.append("data.train_files is empty: give one or more Parquet/Arrow/JSONL files")
    return errs


def _algorithm_errors(cfg: Config) -> list[str]:
    kl, errs = cfg.algorithm.kl_ctrl, []
    if kl.kl_coef < 0:
        errs.append(f"algorithm.kl_ctrl.kl_coef={kl.kl_coef} must be >= 0")
    if kl.type == "adaptive" and (kl.target_kl <= 0 or kl.horizon < 1):
        errs.append(f"algorithm.kl_ctrl.type=adaptive needs target_kl > 0 and horizon >= 1 "
                    f"(got target_kl={kl.target_kl}, horizon={kl.horizon})")
    return errs


def _validation_errors(cfg: Config) -> list[str]:
    """Validation asked for without data (it would silently never run), or a batch of none."""
    t, d, errs = cfg.trainer, cfg.data, []
    if t.val_every < 0:
        errs.append(f"trainer.val_every={t.val_every} must be >= 0 (0: no validation)")
    if (t.val_every > 0 or t.val_before_train) and not d.val_files:
        asked = f"trainer.val_every={t.val_every}" if t.val_every > 0 else "trainer.val_before_train=true"
        errs.append(f"{asked} but data.val_files is empty: give validation files or turn "
                    "validation off (trainer.val_every=0, trainer.val_before_train=false)")
    if d.val_batch_size is not None and d.val_batch_size < 1:
        errs.append(f"data.val_batch_size={d.val_batch_size} must be >= 1 (or null: all "
                    "validation prompts in one batch)")
    return errs


def _dependency_errors(cfg: Config) -> list[str]:
    """Optional packages a config asks for, checked now rather than after hours in a queue."""
    need = []
    if cfg.rollout.engine == "vllm":
        need.append(("vllm", "rollout.engine=vllm", "pip install vllm (or rollout.engine=native)"))
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
