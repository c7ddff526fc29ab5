"""Build the parts of an RL run from a Config, one by one (the trainer uses these; so can you).

    cfg = Config.load("configs/quickstart.yaml")
    groups = build_groups(cfg)                       # after torch.distributed is initialised
    inputs = build_inputs(cfg, world_size)           # everything the user gave, checked
    model = inputs.info                              # HF architecture + tokenizer
    actor = build_actor(cfg, groups, model)
    reference = build_reference(cfg, groups, model, actor)  # None when no KL term needs it
    critic = build_critic(cfg, groups, model)        # None unless algorithm.adv_estimator=gae
    rollout = build_generation_phase(cfg, groups, model, actor)   # generation.GenerationPhase

Weights come from `model.checkpoint` (a dist checkpoint from tools/convert_hf, resharded at load)
or else from the Hugging Face directory `model.path`, read slice by slice straight into each
rank's TP/PP shard (no rank loads the whole model).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch.distributed as dist

from verl_mcore.agent.runtime import AgentRuntime, load_agent_loop
from verl_mcore.agent.tools import check_schema
from verl_mcore.algo.kl import make_kl_controller
from verl_mcore.checkpoints import RunCheckpoints
from verl_mcore.config import Config, ConfigError, ModelShape, validate
from verl_mcore.config.resume import checkpoint_files
from verl_mcore.config.seeds import data_config, data_seed, lora_seed
from verl_mcore.data import PromptLoader, RLHFDataset, load_dataset_class
from verl_mcore.data.checks import check_files
from verl_mcore.distributed.agree import all_ranks_agree
from verl_mcore.distributed.groups import GroupLayout
from verl_mcore.distributed.launch import detect_launch
from verl_mcore.engine.actor import Actor, Reference
from verl_mcore.engine.checkpoint import DIST_DIR
from verl_mcore.engine.critic import Critic
from verl_mcore.engine.engine import DTYPES, MegatronEngine, training_device
from verl_mcore.engine.offload import HostOffloader
from verl_mcore.engine.reward_model import RewardModelScorer, retokenize, same_tokenizer
from verl_mcore.generation import (CrossSetCheck, GenerationPhase, RolloutSetPhase, WeightSender,
                                   rollout_as_run)
from verl_mcore.models.checkpoint import load_dist_checkpoint
from verl_mcore.models.gpt import build_gpt_model, have_transformer_engine, unwrap
from verl_mcore.models.hf_config import generation_eos_ids, read_hf_arch, transformer_config
from verl_mcore.models.hf_weights import (HFCheckpoint, check_tensors, check_weight_files,
                                          load_hf_weights)
from verl_mcore.models.hub import cache_advice, local_dir, run_sources
from verl_mcore.models.load import CKPT_HF_CONFIG_SUBDIR, hf_config_copy
from verl_mcore.models.lora import attach_lora, load_peft_dir, merged_weights
from verl_mcore.planning import memory as planner
from verl_mcore.reward import RewardManager
from verl_mcore.rollout.cross_set import CrossSetPlan, CrossSetTransfer
from verl_mcore.rollout.generate_fn import UserGenerateFn, load_generate_fn
from verl_mcore.rollout.group_filter import GroupFilters
from verl_mcore.rollout.fp8_weights import Fp8LinearWeights
from verl_mcore.rollout import token_fields
from verl_mcore.rollout.native import NativeEngine
from verl_mcore.rollout.repartition import Repartitioner, generation_model_is_training_model
from verl_mcore.rollout.vllm_engine import VLLMEngine
from verl_mcore.tiny_model import ensure_tiny_model
from verl_mcore.user_code import call_with_time_limit
from verl_mcore.utils.device import cuda_in_use

log = logging.getLogger("verl_mcore.build")
# The most tokens a CPU micro-batch holds by default (resolve_micro_batches). There is no device
# memory to plan against on CPU; the cap bounds the fp32 logits a micro-batch keeps (tokens x
# vocabulary x 4 bytes, a few copies: 2.5 GB each at 4,096 tokens of a 152k vocabulary). Packed
# against padded micro-batches on CPU: bench/RESULTS.md 2026-12-07 (the quickstart).
CPU_TOKEN_BUDGET = 4096


@dataclass
class ModelInfo:
    arch: Any  # verl_mcore.models.hf_config.HFArch
    tokenizer: Any
    hf_dir: Optional[str]
    checkpoint: Optional[str]
    tokenizer_dir: Optional[str] = None  # model.tokenizer's directory; None: hf_dir's tokenizer
    # generation_config.json's eos_token_id (models/hf_config.generation_eos_ids)
    generation_eos: tuple[int, ...] = ()

    @property
    def eos_token_ids(self) -> list[int]:
        """Where generation stops: the tokenizer's EOS (first: it also pads), then every other
        EOS of generation_config.json, as transformers' generate stops."""
        ids = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        return ids + [i for i in self.generation_eos if i not in ids]

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else (self.eos_token_ids or [0])[0]


def load_model_info(cfg: Config) -> ModelInfo:
    if cfg.model.path is None:
        raise ConfigError("model.path must name a Hugging Face directory (its config.json and "
                          "tokenizer are needed even when model.checkpoint gives the weights)")
    hf_dir = model_dir(cfg)
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        what = "holds no config.json" if os.path.isdir(hf_dir) else "no such directory"
        snapshot = "" if hf_dir == cfg.model.path else f" (read from {hf_dir})"  # a Hub id's
        raise ConfigError(f"model.path={cfg.model.path}{snapshot}: {what} (a Hugging Face model "
                          f"directory holds config.json, the safetensors and the tokenizer "
                          f"files){cache_advice(hf_dir)}")
    arch = read_hf_arch(hf_dir)
    tokenizer_dir = None
    if cfg.model.tokenizer and cfg.model.tokenizer != cfg.model.path:
        tokenizer_dir = local_dir(cfg.model.tokenizer, None, "model.tokenizer")
        tokenizer = _load_tokenizer(tokenizer_dir, "model.tokenizer", cfg.model.trust_remote_code)
    else:
        tokenizer = _load_tokenizer(hf_dir, "model.path", cfg.model.trust_remote_code)
    return ModelInfo(arch, tokenizer, hf_dir, cfg.model.checkpoint, tokenizer_dir,
                     generation_eos_ids(hf_dir))


def model_dir(cfg: Config) -> Optional[str]:
    """The local directory of model.path: itself, or a Hub id's snapshot (models/hub.py)."""
    return local_dir(cfg.model.path, cfg.model.revision, "model.path")


def _load_tokenizer(where: str, key: str, trust_remote_code: bool, instead: str = "model.tokenizer"):
    """AutoTokenizer from a directory (a Hub id is resolved to its snapshot by the caller),
    failing with the config key and the reason (transformers says `Repo id must be ...` for a
    directory that does not exist); `instead`: the key that names another tokenizer directory."""
    from transformers import AutoTokenizer

    if not os.path.isdir(where):
        raise ConfigError(f"{key}={where}: no such directory (the tokenizer is read from there; "
                          f"set {instead} to the directory that has tokenizer.json / "
                          "tokenizer_config.json)")
    needs = (f"it needs tokenizer.json or tokenizer_config.json with its vocabulary files, or "
             f"set {instead}{cache_advice(where)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; all mean "cannot"
        raise ConfigError(f"{key}={where}: the tokenizer of this directory does not load "
                          f"({type(e).__name__}: {e}); {needs}") from e
    # Without its vocabulary files transformers 5 still builds a tokenizer (from config.json's
    # model type) whose vocabulary is its special tokens alone, and every prompt encodes to
    # nothing: the run would stop at its first generation. (Encoding a probe sentence instead
    # would refuse small word-level test vocabularies, which map English words to nothing.)
    words = set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens)
    if not words:
        raise ConfigError(f"{key}={where}: the tokenizer of this directory turns text into no "
                          f"tokens: its vocabulary holds {len(tokenizer.get_vocab())} special "
                          f"token(s) and nothing else; {needs}")
    return tokenizer


@dataclass
class Inputs:
    """Everything the user supplied, read and checked (build_inputs)."""

    info: ModelInfo
    train_data: Any
    val_data: Any
    rewards: Any  # RewardManager, its scoring workers started
    reward_models: dict = field(default_factory=dict)  # source name -> its checked ModelInfo
    # algorithm.filter_groups and rollout.group_filter, checked (rollout/group_filter.py)
    group_filters: GroupFilters = field(default_factory=GroupFilters)
    # rollout.generate_fn's function, checked (rollout/generate_fn.py), or None
    generate_fn: Optional[UserGenerateFn] = None
    # rollout.agent_loop's runtime, its class checked (agent/runtime.py), or None
    agent_loop: Optional[AgentRuntime] = None


def build_inputs(cfg: Config, world: int, gpus_per_node: Optional[int] = None,
                 local_rank: int = 0) -> Inputs:
    """Read and check everything the user supplies before any model is built (minutes at 70B),
    cheapest first (the preflight), so that a missing data file is not found after a download:

      the config      every numeric range and cross-field rule (config/validate.py)
      the data        the train and val files exist and open; the first rows of each have the
                      columns and prompts the dataset needs (data/checks.check_files)
      the model       written first if model.make_tiny_if_missing; config.json parses and fits
                      the config (lengths, heads); every safetensors header is whole and fits
                      its file (models/hf_weights.check_weight_files); the tokenizer loads and
                      turns text into tokens; reward models alike
      user code       data.custom_cls, the reward code, rollout.group_filter,
                      rollout.generate_fn and rollout.agent_loop imported
                      under their import_timeout_s, the reward's workers started; the group
                      filter's metric checked against what the reward's sources can give

    A config error stops there (the other checks read the config); of the others, the first
    problem of each kind is reported together, in one ConfigError. A Hub id is downloaded, and
    the tiny model written, only after the config and the data passed. Then the datasets are
    read in full (tokenised: prompt lengths) and checked against the reward functions.

    Every rank checks; a problem on any rank stops every rank together (distributed/agree.py),
    as ConfigError (or, on the ranks that passed, AgreedFailure) naming what to fix.
    `local_rank`: this rank's on its node (the tiny model's writer is local rank 0)."""
    if run_sources(cfg):
        # Hub ids: downloaded once per node and pinned for the run, from here on every reader
        # gets the same snapshot directory (models/hub.py); but only for a run whose config and
        # data pass, decided alike on every rank (the download is collective).
        all_ranks_agree(lambda: _raise(_check_config_and_data(cfg, world, gpus_per_node)),
                        "checking the config and data")
        fetch_for_run(cfg)

    def check() -> Inputs:
        problems = _check_config_and_data(cfg, world, gpus_per_node)
        models, rewards, group_filters, generate_fn, agent_loop = None, None, None, None, None
        try:  # with the data wrong, a tiny model still to write waits for the fix
            if ensure_tiny_model(cfg.model, local_rank, write=not problems):
                models = _read_models(cfg, world, gpus_per_node)
        except (ConfigError, ValueError, OSError) as e:  # what a user's model dir raises
            problems.append(str(e))
        try:  # imported under data / reward.import_timeout_s first
            dataset_class = load_dataset_class(cfg.data)
            rewards = build_reward_manager(cfg)
            group_filters = GroupFilters.from_config(cfg, rewards.extra_keys())
            generate_fn = load_generate_fn(cfg.rollout.generate_fn)
        except (ConfigError, ValueError, OSError) as e:
            problems.append(str(e))
        if models is not None:  # the loop's context carries the actor's tokenizer
            try:
                info = models[0]
                agent_loop = load_agent_loop(cfg.rollout.agent_loop, info.tokenizer, info.eos_token_ids,
                                             info.arch.vocab_size)
            except (ConfigError, ValueError, OSError) as e:
                problems.append(str(e))
        if problems:
            if rewards is not None:
                rewards.close()
            _raise(problems)
        info, reward_models = models
        try:
            tools = agent_loop.tools if agent_loop is not None else None
            train, val = build_datasets(cfg, info, dataset_class,
                                        tools=tools.schemas if tools is not None else ())
            if len(train) < cfg.data.train_batch_size:  # PromptLoader's rule, before the models
                raise ConfigError(
                    f"data.train_files: {len(train)} prompts after the data checks, fewer than one "
                    f"batch of data.train_batch_size={cfg.data.train_batch_size}; lower the batch "
                    "size or add data")
            rewards.check_dataset(train)
        except BaseException as e:
            rewards.close()  # its scoring workers are started
            if isinstance(e, (ValueError, OSError)) and not isinstance(e, ConfigError):
                raise ConfigError(str(e)) from e  # what a user's input raises; the rest are bugs
            raise
        return Inputs(info, train, val, rewards, reward_models, group_filters, generate_fn, agent_loop)

    return all_ranks_agree(check, "checking the inputs", cleanup=lambda i: i.rewards.close())


def fetch_for_run(cfg) -> None:
    """Every rank: make each hub id of `cfg` a cached snapshot, downloaded once per node.

    Local rank 0 downloads while the node's other ranks wait in the agreement's all_gather
    (bounded by trainer.collective_timeout_s: download a very large model beforehand with `hf
    download`); then every rank finds the snapshot in its node's cache without network. A
    failure in either step raises on every rank, naming the rank and the key."""
    specs = run_sources(cfg)
    if not specs:  # the same config on every rank: all skip both collectives alike
        return
    local_rank = detect_launch().local_rank  # from the launcher's environment, as the trainer's
    names = ", ".join(f"{key}={where}" for key, where, _ in specs)

    def download() -> None:
        if local_rank == 0:
            for key, where, revision in specs:
                local_dir(where, revision, key)

    all_ranks_agree(download, f"downloading {names} from the Hugging Face Hub")
    all_ranks_agree(lambda: [local_dir(where, revision, key, download=False)
                             for key, where, revision in specs],
                    f"finding {names} in the Hugging Face cache")


def _check_config_and_data(cfg: Config, world: int, gpus_per_node: Optional[int]) -> list[str]:
    """The preflight's first two stages (build_inputs): raises ConfigError for the config alone;
    returns the data's first problem, naming its key ([] when none)."""
    validate(cfg, world, None, gpus_per_node)  # the model's shape is the model stage's
    d = cfg.data
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        if files:
            try:
                check_files(files, d, read=not d.custom_cls.path)
            except (ValueError, OSError) as e:  # DataError, and what pyarrow raises
                return [f"{key}: {e}"]
    return []


def _raise(problems: list[str]) -> None:
    """One ConfigError for the preflight's problems (one per kind), if any."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("the inputs have problems, the first of each kind:\n  - "
                          + "\n  - ".join(problems))


def _read_models(cfg: Config, world: int, gpus_per_node: Optional[int]):
    """(ModelInfo, {reward source name: its ModelInfo}): the run's model directories read and
    checked against the config (the model stage of build_inputs' preflight)."""
    hf_dir = model_dir(cfg)
    shape = ModelShape.from_hf_dir(hf_dir) if hf_dir else None
    validate(cfg, world, shape, gpus_per_node)  # the config passed alone: only the shape's rules
    weights = cfg.model.checkpoint is None and hf_dir and os.path.isdir(hf_dir)
    if weights:
        check_weight_files(hf_dir)
    info = load_model_info(cfg)
    if weights:
        check_model_tensors(hf_dir, info.arch)
    reward_models = {}
    for key, source in reward_model_sources(cfg):  # config, weights headers, tokenizer
        reward_models[source.name] = reward_model_info(cfg, key, source)
        check_reward_model_tokens(cfg, info, key, reward_models[source.name])
    return info, reward_models


def check_model_tensors(hf_dir: str, arch, role: str = "actor") -> None:
    """Every tensor the `role`'s model reads from model.path is in its safetensors with the shape
    config.json implies, from the headers alone: checked before any model is built, or a
    reward model's directory given as the policy's fails in the weight load after the build."""
    try:
        check_tensors(HFCheckpoint(hf_dir), arch, role)
    except KeyError as e:  # e.g. a reward model's directory: `score`, no `lm_head`
        reward_model = (" (config.json names a *ForSequenceClassification: a reward model)"
                        if arch.num_labels is not None else "")
        raise ConfigError(f"{e.args[0]} (model.path): these are not the weights of the causal LM "
                          f"config.json describes{reward_model}; point model.path at the "
                          "policy's *ForCausalLM directory") from None
    except ConfigError as e:  # a tensor of another shape
        raise ConfigError(f"{e} (model.path)") from None


def _weight_loader(info: ModelInfo, role: str, lora=None, seed: int = 0):
    """Fills one freshly built model chunk with the run's initial weights; with `lora` enabled
    it then gets its adapters (models/lora.py: the base frozen, the adapters from their seed or
    from lora.init_from)."""
    def load(module):
        if info.checkpoint:
            load_dist_checkpoint(module, info.checkpoint, role=role)
        else:
            load_hf_weights(module, info.arch, info.hf_dir, role=role)
        if lora is not None and lora.enable:
            adapters = attach_lora(module, lora, info.arch, seed=seed,
                                   trainable=("output_layer",) if role == "critic" else ())
            if lora.init_from:
                load_peft_dir(adapters, lora.init_from, lora)

    return load


def role_lora(cfg: Config, role: str):
    """The role's LoRAConfig when it trains adapters, else None."""
    lora = {"actor": cfg.actor.lora, "critic": cfg.critic.lora}.get(role)
    return lora if lora is not None and lora.enable else None


def _transformer_config(cfg: Config, info: ModelInfo, dtype: str, tp: int, pp: int, vpp=None,
                        training: bool = True):
    extra = {}
    if vpp and vpp > 1:
        extra["virtual_pipeline_model_parallel_size"] = vpp
    if cfg.parallel.sequence_parallel and tp > 1:
        extra["sequence_parallel"] = True
    if info.arch.moe is not None and training:
        # The training layout's expert parallelism (groups.build_set_groups initialised it);
        # a generation model holds every expert (EP_g = 1, its TransformerConfig's default).
        extra["expert_model_parallel_size"] = cfg.parallel.expert_model_parallel_size
    if info.arch.moe is not None and cfg.parallel.moe_aux_loss_coeff is not None:
        extra["moe_aux_loss_coeff"] = cfg.parallel.moe_aux_loss_coeff
    return transformer_config(info.arch, tp=tp, pp=pp, dtype=dtype, **extra)


def padded_vocab(cfg: Config, arch) -> int:
    """The padded vocabulary of every model of the run: the training layout's, a multiple of
    lcm(model.make_vocab_size_divisible_by, TP_t) (models/hf_config.padded_vocab_size).

    The generation model takes this same size whatever its TP_g: its vocabulary shards are then
    TP_t / TP_g training shards end to end (TP_g divides TP_t, so it divides this size too).
    Padding for TP_g instead, or by Megatron's divisible × TP rule, gives another size for most
    vocabularies (36 ids at TP_t = 2 -> TP_g = 1: 128 rows here, 256 by that rule)."""
    return arch.padded_vocab_size(cfg.parallel.tensor_model_parallel_size,
                                  cfg.model.make_vocab_size_divisible_by)


def role_padded_vocab(cfg: Config, arch, role: str, tp: int) -> int:
    """padded_vocab for a role whose set runs at TP = `tp`: the run's one size, which that TP
    must divide (its vocabulary shards are then whole rows). A role set's TP that does not is
    refused, naming the sizes: checkpoints and the repartition need one vocabulary size."""
    vocab = padded_vocab(cfg, arch)
    if vocab % tp:
        raise ValueError(
            f"the {role}'s TP={tp} does not divide the run's padded vocabulary of {vocab} rows "
            f"(padded for the actor's parallel.tensor_model_parallel_size="
            f"{cfg.parallel.tensor_model_parallel_size} and model.make_vocab_size_divisible_by="
            f"{cfg.model.make_vocab_size_divisible_by}); give the {role} a TP that divides "
            f"{vocab}, or raise model.make_vocab_size_divisible_by to a multiple of {tp}")
    return vocab


_ROLE_SEEDS = {"actor": 1, "reference": 2, "critic": 3, "reward_model": 4}


@contextlib.contextmanager
def role_seed(seed: int, role: str):
    """torch's CPU RNG seeded for building one role (trainer.seed and the role), and put back
    after: a fresh value head is then the same whichever roles a process built before it (a
    placed critic's set builds nothing else; the Python API builds in the user's order)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 7919 + _ROLE_SEEDS[role])
        yield


def declare_token_fields(cfg: Config, info: ModelInfo) -> None:
    """The per-token fields this run's samples carry beyond the built-in ones, declared the
    same on every rank (rollout/token_fields.py): the engine's routing under
    actor.router_replay=rollout, shaped (layers, top-k) by the model."""
    if replays_routing(cfg):
        if info.arch.moe is None:
            raise ValueError(f"actor.router_replay={cfg.actor.router_replay}: model "
                             f"{cfg.model.path} is dense; set actor.router_replay=off")
        token_fields.declare(token_fields.routing_field(info.arch.num_layers, info.arch.moe.topk))
    else:
        token_fields.retract(token_fields.ROUTED_EXPERTS)


def replays_routing(cfg: Config) -> bool:
    """Whether the engine records routing and the actor and reference replay it."""
    return cfg.actor.router_replay == "rollout"


def build_engine(cfg: Config, groups, info: ModelInfo, role: str, dtype: str, optim=None,
                 recompute: bool = False, lr_decay_steps: int = 1):
    """The role's MegatronEngine on its set: TP / PP / VPP from `groups.layout` (the role's
    set, which the placement gives its own layout), every group from `groups.train`. The
    actor and the reference replay the engine's routing under actor.router_replay=rollout."""
    lay = groups.layout
    config = _transformer_config(cfg, info, dtype, lay.tp, lay.pp, lay.vpp)
    arch, vocab = info.arch, role_padded_vocab(cfg, info.arch, role, lay.tp)
    pg = groups.train
    lora = role_lora(cfg, role)
    if lora is not None and lora.lr is not None and optim is not None:
        # Only the adapters train (and a critic's value head): lora.lr is the role's rate.
        optim = dataclasses.replace(optim, lr=lora.lr)

    def provider(config, pre_process, post_process, vp_stage):
        # LoRA hooks megatron's own parallel linears; TransformerEngine's fuse the input
        # layer norm into linear_qkv / linear_fc1, whose input is then not the adapter's.
        return build_gpt_model(arch, config, role=role, pre_process=pre_process,
                               post_process=post_process, vp_stage=vp_stage, padded_vocab=vocab,
                               pg_collection=pg, use_te=False if lora else None)

    loader = _weight_loader(info, role if role in ("critic", "reward") else "actor", lora=lora,
                            seed=lora_seed(cfg, role) if lora is not None else 0)
    return MegatronEngine(provider, config, pg, dtype=dtype, optim=optim,
                          recompute_activations=recompute, lr_decay_steps=lr_decay_steps,
                          use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                          load_weights=loader, vocab_size=info.arch.vocab_size,
                          router_replay=replays_routing(cfg) and role in ("actor", "reference"))


def optimizer_steps_per_training_step(cfg: Config, role: str) -> int:
    """The optimizer steps `role` ("actor" / "critic") takes per training step: the LR
    schedule's unit (its length is total_steps times this; a resume rescales its position when
    this changes, config/resume.py)."""
    a = cfg.actor
    if role == "actor":
        mini, epochs = a.ppo_mini_batch_size, a.ppo_epochs
    else:
        mini = cfg.critic.ppo_mini_batch_size or a.ppo_mini_batch_size
        epochs = cfg.critic.ppo_epochs or a.ppo_epochs
    return epochs * (cfg.data.train_batch_size // mini)


def build_actor(cfg: Config, groups, info: ModelInfo):
    declare_token_fields(cfg, info)  # (again: the Python API builds no run_parts)
    a = cfg.actor
    steps = cfg.trainer.total_steps * optimizer_steps_per_training_step(cfg, "actor")
    engine = build_engine(cfg, groups, info, "actor", a.dtype, optim=a.optim,
                          recompute=a.recompute_activations, lr_decay_steps=steps)
    return Actor(engine, a, mini_batch_size=a.ppo_mini_batch_size * cfg.rollout.n,
                 temperature=cfg.rollout.temperature or 1.0,
                 norm_len=float(cfg.data.max_response_length))


def needs_reference(cfg: Config) -> bool:
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def build_reference(cfg: Config, groups, info: ModelInfo, actor=None):
    """The reference policy, or None when no KL term needs it. With actor.lora it is the
    actor's own model with its adapters off (`actor` must be given): no second copy."""
    if not needs_reference(cfg):
        return None

    kwargs = dict(temperature=cfg.rollout.temperature or 1.0,
                  max_tokens_per_microbatch=cfg.actor.max_tokens_per_microbatch,
                  micro_batch_size=cfg.actor.micro_batch_size_per_gpu)
    if role_lora(cfg, "actor"):
        if actor is None:
            raise ValueError("build_reference: with actor.lora.enable the reference is the "
                             "actor's base model; pass the actor")
        return Reference(actor.engine, adapters_off=True, **kwargs)
    engine = build_engine(cfg, groups, info, "reference", cfg.reference.dtype)
    return Reference(engine, offload_params=cfg.reference.offload_params, **kwargs)


def build_critic(cfg: Config, groups, info: ModelInfo):
    if not cfg.uses_critic:
        return None

    c = cfg.critic
    mini = c.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size
    epochs = c.ppo_epochs or cfg.actor.ppo_epochs
    steps = cfg.trainer.total_steps * optimizer_steps_per_training_step(cfg, "critic")
    engine = build_engine(cfg, groups, info, "critic", c.dtype, optim=c.optim,
                          recompute=c.recompute_activations, lr_decay_steps=steps)
    return Critic(engine, c, mini_batch_size=mini * cfg.rollout.n, ppo_epochs=epochs,
                  agg_mode=cfg.actor.loss_agg_mode, norm_len=float(cfg.data.max_response_length))


def build_generation_model(cfg: Config, groups, info: ModelInfo, actor):
    """(generation model, repartitioner or None). When the generation layout equals the training
    layout (TP_g = TP_t, PP = 1) the actor's own model serves generation: nothing is copied."""
    lay = groups.layout  # the actor's set
    tp_g = lay.tp_gen
    # With LoRA the generation model holds W + (alpha/r)·B·A, so it is a model of its own even
    # in the training layout: the base weights are never merged in place.
    # A MoE model's engine runs each layer's experts as one grouped GEMM over their weights
    # stacked in the generation buffer (rollout/moe_mlp.py); the training model holds them
    # apart (and under EP only its own block), so MoE generation always has a model of its own.
    if not role_lora(cfg, "actor") and info.arch.moe is None and \
            generation_model_is_training_model(lay.tp, lay.pp, tp_g, lay.vpp):
        return unwrap(actor.engine.model[0]), None

    # The training model's padded vocabulary, so its vocab shards concatenate into ours; the
    # Repartitioner refuses two different sizes before any weight moves. On the training
    # model's device.
    gen = generation_gpt(cfg, info, groups.gen, tp_g, padded_vocab(cfg, info.arch),
                         training_device())
    chunks = [unwrap(m) for m in actor.engine.model]
    merge = lora_merge(cfg, chunks)
    return gen, Repartitioner(chunks, gen, groups, gated_linear_unit=True, merge=merge,
                              fp8=fp8_generation_weights(cfg, gen, in_place=True))


def fp8_generation_weights(cfg: Config, model, in_place: bool) -> Optional[Fp8LinearWeights]:
    """The e4m3 copy of the generation model's linear weights under rollout.dtype=fp8 (None
    otherwise): in place for a generation model of its own (the repartition or transfer
    quantizes into it), a copy of the training model's when that serves generation."""
    if cfg.rollout.dtype != "fp8":
        return None
    return Fp8LinearWeights.in_place(model) if in_place else Fp8LinearWeights.copy_of(model)


def generation_gpt(cfg: Config, info: ModelInfo, pg_collection, tp_g: int, vocab: int, device):
    """An empty generation-layout model (TP_g, every layer) in the actor's compute dtype, its
    weights to be written by a repartition or a cross-set transfer."""
    config = _transformer_config(cfg, info, cfg.actor.dtype, tp_g, 1, training=False)
    config.perform_initialization = False  # every weight is written before use
    gen = build_gpt_model(info.arch, config, role="actor", pg_collection=pg_collection,
                          pre_process=True, post_process=True, padded_vocab=vocab,
                          use_te=False if role_lora(cfg, "actor") else None)  # training's spec
    # Every tensor in the actor's compute dtype, as Float16Module casts the training model:
    # megatron allocates its linears in params_dtype, but the torch norms come in fp32.
    return gen.to(device=device, dtype=DTYPES[cfg.actor.dtype]).eval().requires_grad_(False)


def lora_merge(cfg: Config, chunks) -> Optional[dict]:
    """{weight name: adapter} the generation weights receive merged (W + (alpha/r)·B·A), None
    without LoRA on the actor."""
    if not role_lora(cfg, "actor"):
        return None

    return merged_weights(chunks)


def build_generation_phase(cfg, groups, info, actor) -> GenerationPhase:
    """The engine named by rollout.engine, over the actor's weights in the generation layout
    (generation.py's GenerationPhase)."""
    r = rollout_as_run(cfg)
    model, repartitioner = build_generation_model(cfg, groups, info, actor)
    engine = _rollout_engine(cfg, groups, info, model, repartitioner)
    return GenerationPhase(engine, actor, groups, r, info.eos_token_ids,
                           cfg.data.max_response_length, info.pad_token_id)


def _rollout_engine(cfg, groups, info, model, repartitioner):
    """The engine named by rollout.engine over `model` (the generation layout's weights, which
    `repartitioner` fills) on `groups`' generation TP group."""
    r = cfg.rollout
    if r.engine == "vllm":
        return VLLMEngine.from_config(cfg, groups, info, model, repartitioner)

    fp8 = None
    if r.dtype == "fp8":  # the repartition's (or transfer's) store, or a copy of the training model's
        fp8 = (repartitioner.fp8 if repartitioner is not None
               else fp8_generation_weights(cfg, model, in_place=False))
    engine = NativeEngine(model, vocab_size=info.arch.vocab_size,
                          tp_group=groups.gen_tp if r.tensor_parallel_size > 1 else None,
                          repartitioner=repartitioner, keep_weights_buffer=r.keep_weights_buffer,
                          max_num_seqs=r.max_num_seqs,
                          gpu_memory_utilization=r.gpu_memory_utilization, fp8_weights=fp8,
                          record_routing=replays_routing(cfg))
    if dist.get_rank() == 0:
        log.info("native engine: decode attention %s (%s), fused decode step %s, CUDA graphs %s",
                 engine.attention or "reference", engine.attention_reason,
                 engine.fused or engine.fused_decode_reason, engine.use_graphs)
    return engine


def build_rollout_set_phase(cfg, place, info, actor):
    """placement.rollout's two sides: a RolloutSetPhase on the rollout set's ranks, a
    WeightSender on the actor's, None elsewhere. Collective over the two sets (the transfer
    agrees its catalog of tensors there, once)."""
    r, sets = rollout_as_run(cfg), place.placement.sets
    a = sets["actor"]
    plan = CrossSetPlan(GroupLayout(len(a.ranks), a.tp, a.pp, a.cp, ranks=a.ranks, vpp=a.vpp),
                        sets["rollout"].ranks, r.tensor_parallel_size)
    cross_check = CrossSetCheck(cfg, place, info)
    if place.runs("rollout"):
        groups = place.groups["rollout"]
        gen = generation_gpt(cfg, info, groups.gen, r.tensor_parallel_size,
                             role_padded_vocab(cfg, info.arch, "rollout", r.tensor_parallel_size),
                             training_device())
        transfer = CrossSetTransfer(plan, place.rank, True, gen_model=gen, group=place.link,
                                    fp8=fp8_generation_weights(cfg, gen, in_place=True))
        return RolloutSetPhase(_rollout_engine(cfg, groups, info, gen, transfer), groups, r,
                               info.eos_token_ids, cfg.data.max_response_length,
                               info.pad_token_id, cross_check)
    if place.runs("actor"):
        chunks = [unwrap(m) for m in actor.engine.model]
        transfer = CrossSetTransfer(plan, place.rank, True, train_chunks=chunks,
                                    merge=lora_merge(cfg, chunks), group=place.link)
        return WeightSender(transfer, actor, r, cross_check)
    return None


def build_reward_manager(cfg: Config):
    # The trainer scores its reward models itself (collectively, on the whole batch) and hands
    # the manager their scores with each batch.
    return RewardManager.from_config(cfg.reward, scored_outside=[
        s.name for s in cfg.reward.sources if s.type == "reward_model"])


def reward_model_sources(cfg: Config) -> list[tuple[str, Any]]:
    """(config key, source) of every reward_model source."""
    return [(f"reward.sources[{i}]", s) for i, s in enumerate(cfg.reward.sources)
            if s.type == "reward_model"]


def reward_model_info(cfg: Config, key: str, source) -> ModelInfo:
    """The reward model's architecture, tokenizer and weights, read and checked before any model
    is built: `path` is an HF *ForSequenceClassification directory, or a dist checkpoint whose
    hf_config/ holds its config.json and tokenizer (tools/convert_hf)."""
    where = f"{key}.path={source.path}"
    path = local_dir(source.path, source.revision, f"{key}.path")
    if not path or not os.path.isdir(path):
        raise ConfigError(f"{where}: no such directory (a reward model is an HF "
                          "*ForSequenceClassification directory or a dist checkpoint)")
    checkpoint = None
    hf_dir = path
    if not os.path.isfile(os.path.join(path, "config.json")):
        hf_dir = os.path.join(path, CKPT_HF_CONFIG_SUBDIR)
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise ConfigError(f"{where}: neither an HF directory (no config.json) nor a dist "
                              f"checkpoint (no {CKPT_HF_CONFIG_SUBDIR}/config.json)"
                              f"{cache_advice(path)}")
        checkpoint = path
    try:
        arch = read_hf_arch(hf_dir)
    except ValueError as e:  # UnsupportedConfigError, ConfigError: name this source's key
        raise ConfigError(f"{where}: {e}".replace("(model.path)", f"({key}.path)")) from e
    if arch.num_labels is None:
        raise ConfigError(f"{where}: config.json's architectures name no "
                          "*ForSequenceClassification model, so there is no `score` head to read "
                          "a reward from")
    if arch.num_labels != 1:
        raise ConfigError(f"{where}: a classifier with {arch.num_labels} labels; a reward model "
                          "has one output (num_labels=1), and which label would be the reward is "
                          "not something to guess")
    if checkpoint is None and "score.weight" not in check_weight_files(hf_dir, f"{key}.path"):
        raise ConfigError(f"{where}: its safetensors hold no `score.weight`: config.json says "
                          "*ForSequenceClassification but these are not a reward model's weights")
    own = not source.tokenizer or source.tokenizer == source.path
    tokenizer = _load_tokenizer(hf_dir if own else local_dir(source.tokenizer, None,
                                                            f"{key}.tokenizer"),
                                f"{key}.tokenizer",
                                cfg.model.trust_remote_code, instead=f"{key}.tokenizer")
    if len(tokenizer) > arch.vocab_size:
        raise ConfigError(f"{key}: its tokenizer has {len(tokenizer)} ids but the model only "
                          f"{arch.vocab_size} embeddings (vocab_size): ids past them would read "
                          "padding rows; set its tokenizer to the model's own")
    return ModelInfo(arch, tokenizer, hf_dir, checkpoint)


def check_reward_model_tokens(cfg: Config, info: ModelInfo, key: str, rm: ModelInfo) -> None:
    """What the reward model will be fed, checked before any model is built: the actor's ids as
    they are (the same tokenizer) within its positions, or its own re-tokenisation of a sample,
    which must give tokens (a tokenizer that loads can still turn text into nothing)."""
    d = cfg.data
    if same_tokenizer(info.tokenizer, rm.tokenizer):
        longest = d.max_prompt_length + d.max_response_length
        if longest > rm.arch.max_position_embeddings:
            raise ConfigError(
                f"{key}: data.max_prompt_length + data.max_response_length = {longest} tokens, "
                f"more than the reward model's max_position_embeddings="
                f"{rm.arch.max_position_embeddings}; shorten them")
        return
    answer = "The answer is 5."
    probe = retokenize(rm.tokenizer, {"prompt": [{"role": "user", "content": "What is 2 + 3?"}]},
                       answer, "prompt")
    decoded = rm.tokenizer.decode(probe, skip_special_tokens=True)
    if len(probe) < 2 or "".join(answer.split()) not in "".join(decoded.split()):
        raise ConfigError(f"{key}: its tokenizer (not the actor's, so samples are re-tokenised "
                          f"with it) does not read text back: {answer!r} in a chat became "
                          f"{len(probe)} token(s) that decode to {decoded[:80]!r}; set its "
                          "tokenizer to the reward model's own")


def build_reward_models(cfg: Config, groups, info: ModelInfo,
                        rm_infos: Optional[dict] = None) -> dict[str, Any]:
    """name -> RewardModelScorer for every reward_model source, on every rank. rm_infos: the
    sources' ModelInfo as build_inputs read and checked them (read here when not given)."""
    out = {}
    for key, s in reward_model_sources(cfg):
        rm_info = (rm_infos or {}).get(s.name) or reward_model_info(cfg, key, s)
        engine = build_engine(cfg, groups, rm_info, "reward", s.dtype)
        packed = s.max_tokens_per_microbatch or (None if s.micro_batch_size else
                                                 cfg.actor.max_tokens_per_microbatch)
        out[s.name] = RewardModelScorer(
            engine, s.name, tokenizer=rm_info.tokenizer,
            retokenize=not same_tokenizer(info.tokenizer, rm_info.tokenizer),
            prompt_key=cfg.data.prompt_key, max_positions=rm_info.arch.max_position_embeddings,
            max_tokens_per_microbatch=packed,
            micro_batch_size=s.micro_batch_size or cfg.actor.micro_batch_size_per_gpu)
    return out


def read_time_limit(cfg: Config) -> float:
    """data.read_timeout_s; null: 3/4 of trainer.collective_timeout_s, which bounds how long the
    ranks done reading wait for the others (config/schema.py)."""
    d = cfg.data
    return d.read_timeout_s if d.read_timeout_s is not None else 0.75 * cfg.trainer.collective_timeout_s


def build_datasets(cfg: Config, info: ModelInfo, cls: Optional[type] = None,
                   tools: Sequence[dict] = ()):
    """(train, val or None), both built within data.read_timeout_s: a reader that blocks (a
    data.custom_cls waiting on the network, a lock, input()) fails naming its class, its file
    and where it was, and build_inputs' agreement then stops every rank. `cls`: the dataset
    class when already loaded (data.load_dataset_class: build_inputs' user-code check);
    `tools`: the agent loop's tool schemas, shown in the prompts where data.tools is empty."""
    d = data_config(cfg)  # data.seed as the run draws it (max_samples' choice)
    for i, schema in enumerate(d.tools):  # given by hand: shown as they are, so checked first
        check_schema(schema, f"data.tools[{i}]")
    if tools and not d.tools:
        d = dataclasses.replace(d, tools=list(tools))
    cls = cls or load_dataset_class(d)  # imported under data.import_timeout_s first
    limit = read_time_limit(cfg)
    reading: list = []  # the split being read, for the message

    def build(split: str, files):
        reading[:] = [split, files]
        return cls(files, info.tokenizer, d)

    def late(where: str) -> str:
        split, files = reading
        who = ("RLHFDataset (the default reader)" if cls is RLHFDataset else
               f"data.custom_cls {cls.__name__} ({os.path.abspath(d.custom_cls.path)})")
        return (f"{who} did not finish building the {split} dataset ({', '.join(map(str, files))})"
                f" within data.read_timeout_s={limit:g} s (train and val together); it was here "
                f"(most recent call last):\n{where}\nA read that blocks (a network call, a lock, "
                f"a sleep, input()) would hang every rank: fix it, or raise data.read_timeout_s "
                f"(below trainer.collective_timeout_s={cfg.trainer.collective_timeout_s:g}) if "
                f"the reading is only slow")

    return call_with_time_limit(
        lambda: (build("train", d.train_files), build("val", d.val_files) if d.val_files else None),
        limit, late, "dataset reader")


def resolve_run_dir(cfg: Config) -> str:
    return os.path.abspath(cfg.trainer.run_dir)


def prompt_shard(groups) -> tuple[int, int]:
    """(this rank's share, shares) of each prompt batch: its generation replica's among DP_g
    (all ranks of a TP_g group share one); off the actor set (groups None: placement) the whole
    batch, in the order the actor set's gathered rollout has it (distributed/placement.py)."""
    return (groups.gen_dp_rank, groups.layout.dp_gen) if groups is not None else (0, 1)


def build_prompt_loader(cfg: Config, dataset, groups):
    """Training prompts for this rank's share (prompt_shard)."""
    rank, shares = prompt_shard(groups)
    return PromptLoader(dataset, cfg.data.train_batch_size, rank=rank, world_size=shares,
                        shuffle=cfg.data.shuffle, seed=data_seed(cfg))


def build_kl_controller(cfg: Config):
    k = cfg.algorithm.kl_ctrl
    return make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)


def build_checkpointers(cfg: Config, run_dir: str, info: ModelInfo,
                        role_ranks: Optional[dict] = None):
    """The run's checkpoints, with the planner's estimate of their size (for the disk-space
    check before each save) and the record each actor checkpoint carries: the run's config, its
    model's architecture, and a copy of the HF config and tokenizer files under
    dist/hf_config/ (where hf-to-mcore keeps them), so that mcore-to-hf makes an HF model of a
    checkpoint with nothing but --ckpt and --out. role_ranks:
    {"actor" / "critic": global ranks} of roles on sets of their own (checkpoints.RunCheckpoints;
    None: colocated)."""
    try:
        expected = planner.checkpoint_bytes(cfg, planner.resolve_dims(info.hf_dir or cfg.model.path))
    except ConfigError as e:
        log.warning("no estimate of the checkpoint size (%s): no disk-space check before saves", e)
        expected = None
    hf_files = {f"{DIST_DIR}/{CKPT_HF_CONFIG_SUBDIR}/{name}": content
                for name, content in hf_config_copy(info.hf_dir, info.tokenizer_dir).items()}
    return RunCheckpoints(cfg.checkpoint, run_dir, with_critic=cfg.uses_critic,
                          expected_bytes=expected,
                          run_files={**checkpoint_files(cfg, info.arch), **hf_files},
                          role_ranks=role_ranks, base_weights=info.checkpoint or info.hf_dir)


def resolve_micro_batches(cfg: Config, info: ModelInfo, world: int,
                          gpus_per_node: int) -> tuple[Config, list[str]]:
    """`cfg` with a token budget for each trained role that sets neither micro-batch key, and
    one log line per role saying which path it runs and why (planner.micro_batch_report).

    On a GPU the planner chooses the budget from the model's shape and the smallest GPU of the
    job (planner.choose_token_budgets, under the offload policy resolve_offload then applies).
    On CPU there is no device memory to fit: at most CPU_TOKEN_BUDGET tokens. Without a model
    shape for the planner: at most BUDGET_EFFICIENT_TOKENS."""
    roles = planner.budget_roles(cfg)
    if not roles:
        return cfg, planner.micro_batch_report(cfg, {})
    ladder = planner.budget_ladder(cfg, world, roles)
    if cuda_in_use():
        try:
            dims = planner.resolve_dims(info.hf_dir or cfg.model.path)
        except ConfigError as e:
            limit, why = planner.BUDGET_EFFICIENT_TOKENS, f"no model shape for the planner ({e})"
        else:
            knobs = planner.Knobs(gpus_per_node=gpus_per_node, gpu_memory_gib=_smallest_gpu_gib())
            cfg, chosen = planner.choose_token_budgets(cfg, dims, world, knobs)
            return cfg, planner.micro_batch_report(cfg, chosen)
    else:
        limit, why = CPU_TOKEN_BUDGET, "on CPU"
    tokens = next((t for t in ladder if t <= limit), ladder[-1])
    cfg = planner.with_token_budget(cfg, roles, tokens)
    why += f": the largest budget of at most {limit} tokens of {planner.ladder_text(ladder)}"
    return cfg, planner.micro_batch_report(cfg, dict.fromkeys(roles, why))


def resolve_offload(cfg: Config, info: ModelInfo, world: int, gpus_per_node: int) -> tuple[bool, str]:
    """trainer.offload_between_phases for this run: (offload?, why). "auto" asks the planner with
    the memory of the job's smallest GPU (planner.choose_offload); on CPU there is no device memory
    to free.

    When even offloading leaves a phase over the GPU's memory, "auto" refuses to start (a run
    that would run out of memory an hour into the queue), naming the phases and what they need
    (ConfigError on every rank alike; train.py exits 2). An explicit true / false is taken as
    set, with a warning. The estimates are for megatron's local layer spec (what bench/RESULTS.md
    measured): with TransformerEngine installed they only warn."""
    setting = cfg.trainer.offload_between_phases
    explicit = setting != "auto"
    as_set = (setting, f"trainer.offload_between_phases={str(setting).lower()}")
    if not cuda_in_use():
        return as_set if explicit else (False, "auto: on CPU the training state already lives in host memory")
    try:
        dims = planner.resolve_dims(info.hf_dir or cfg.model.path)
    except ConfigError as e:  # no HF config.json to read the shape from: the safe choice
        return as_set if explicit else (True, f"auto: no model shape for the planner ({e})")
    gpu_gib = _smallest_gpu_gib()
    knobs = planner.Knobs(gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_gib)
    try:
        offload, why, memory = planner.plan_with_offload_choice(cfg, dims, world, knobs)
    except Exception as e:  # noqa: BLE001 - the user chose; a planner bug must not stop the run
        if not explicit:
            raise
        log.warning("memory planner failed (%s: %s); offload as set", type(e).__name__, e)
        return as_set
    bad = [n for n in planner.misfits(memory, knobs) if n != "host"]
    if not bad:
        return offload, why
    need = ", ".join(f"{n} {memory[n]['total'] / planner.GiB:.1f} GiB" for n in bad)
    msg = (f"the memory planner finds that with offload between phases {'on' if offload else 'off'} "
           f"{need} would not fit the {gpu_gib * planner.USABLE_FRACTION:.1f} usable GiB of this GPU; "
           f"`python -m verl_mcore.plan --config ... --gpu-memory-gb {gpu_gib:.0f}` with this run's "
           "overrides names the changes that make it fit (recompute, smaller micro-batches, more "
           "parallelism)")
    if explicit or have_transformer_engine():
        # TE's fused layers keep fewer activations than the local spec the model is calibrated on.
        log.warning("%s; trying anyway (%s)", msg,
                    as_set[1] if explicit else "TransformerEngine installed: the estimate may be high")
        return offload, why
    raise ConfigError(msg + "; or set trainer.offload_between_phases=true/false to try anyway")


def _smallest_gpu_gib() -> float:
    """GiB of the smallest GPU of the job (all ranks agree: a mixed job plans for the smallest,
    and every rank takes the same offload decision)."""
    import torch
    import torch.distributed as dist

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([float(total)], device=torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        total = t.item()
    return total / 2**30


def build_offloaders(cfg: Config, actor, critic, offload: bool) -> dict:
    """{role: HostOffloader} for the trainable roles when `offload` (resolve_offload)."""
    if not offload:
        return {}

    return {name: HostOffloader(role.engine.model, role.engine.optimizer)
            for name, role in (("actor", actor), ("critic", critic)) if role is not None}