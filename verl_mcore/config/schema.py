"""The config schema: one tree of typed dataclasses. YAML is only an input format.

Batch sizes, in one place (verl's conventions, which RLHF users already know):
  data.train_batch_size        prompts per training step, global (all ranks together)
  rollout.n                    responses sampled per prompt -> samples per step = prompts × n
  actor.ppo_mini_batch_size    prompts per optimizer step, global: each step's samples are cut into
                               train_batch_size / ppo_mini_batch_size mini-batches per PPO epoch
  actor.max_tokens_per_microbatch tokens per forward/backward on one rank (packed path:
                               micro-batches are formed by this token budget, balanced across
                               ranks), or
  actor.micro_batch_size_per_gpu  samples per forward/backward on one rank (padded path, as verl
                               users write it). With neither set (the default) the trainer packs
                               with a budget the memory planner derives from the model and the
                               GPU's memory (plan.choose_token_budgets; the log and
                               `verl-mcore-plan` say which budget and why).
Every "per_gpu" size is per data-parallel rank; everything else is global.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from verl_mcore import shipped
from verl_mcore.config.loading import apply_override, from_dict, load_yaml, parse_override, to_dict

Dtype = Literal["bf16", "fp16", "fp32"]
# KL estimators (algo/kl.py KL_PENALTIES): ours and verl's names; "+" = the value of the named
# estimator with k2's gradient (verl's straight-through form).
KLKind = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl",
                 "k1+", "kl+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+"]


@dataclass
class ModelConfig:
    # Hugging Face directory, or a Hub id `org/name`: converted on the fly and sharded straight
    # into each rank's TP/PP slice. Exactly one of path / checkpoint is the weight source; with
    # both, `checkpoint` (a dist checkpoint from tools/convert_hf) supplies the weights and
    # `path` the HF config and tokenizer. A Hub id is read from huggingface_hub's cache
    # (HF_HOME / HF_HUB_CACHE), downloaded there first by local rank 0 of each node unless
    # HF_HUB_OFFLINE=1 (models/hub.py); config.yaml keeps the id. Paths (absolute, ./, ../, ~,
    # or not exactly one '/') are never looked up on the Hub.
    path: Optional[str] = None
    checkpoint: Optional[str] = None
    # Branch, tag or commit hash of a Hub id in `path` (and in `tokenizer` when it is the same
    # id); None: the default branch. A commit hash pins the run to exact files.
    revision: Optional[str] = None
    tokenizer: Optional[str] = None  # defaults to `path`; a directory or a Hub id
    trust_remote_code: bool = False
    # When `path` holds no model yet, write the quickstart's tiny random model there first
    # (verl_mcore/tiny_model.py: Qwen2 architecture, 2 layers, a 36-token tokenizer, seed 0; the
    # very files `python -m tools.make_tiny_model --out PATH` writes), so the quickstart is one
    # command with no download. Local rank 0 of each node writes it into a temporary directory
    # renamed at the end (a killed first run leaves no half model); the node's other ranks wait.
    # A model already at `path` is used as it is. It writes only at the quickstart's own path,
    # `runs/quickstart/tiny_model` (relative to the current directory): as in verl or NeMo-RL,
    # model.path names a model that exists, so a config copied from the quickstart whose
    # model.path is mistyped or not downloaded yet stops, naming model.path, instead of training
    # a random model and exiting 0. A tiny model elsewhere: `python -m verl_mcore.tiny_model
    # --out PATH` first.
    make_tiny_if_missing: bool = False
    # Pad the vocabulary to a multiple of lcm(this, training TP) (Megatron's option of that name,
    # whose own rule is this × TP); the generation model keeps that same padded size.
    make_vocab_size_divisible_by: int = 128


@dataclass
class ParallelConfig:
    """Training layout. DP is derived: world / (TP × PP × CP)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    # Mixture-of-experts models: the experts split over this many ranks of each data-parallel
    # group (it must divide DP and the number of experts); colocated runs only. Generation keeps
    # every expert on each rank (rollout/moe_mlp.py).
    expert_model_parallel_size: int = 1
    # The load-balancing loss coefficient of MoE training (megatron's moe_aux_loss_coeff, added
    # per MoE layer); null: the HF config's router_aux_loss_coef mapped to megatron's form when
    # output_router_logits is true, else 0 (models/hf_config.MoESpec says how).
    moe_aux_loss_coeff: Optional[float] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True


@dataclass
class LogprobCheckConfig:
    """After each weight update, compare engine and trainer log-probs of a few sampled sequences:
    with the engine on the actor's ranks, a few of the step's own samples (one per prompt first),
    which costs the trainer one small forward (vLLM under top_p < 1 or top_k > 0, whose log-probs
    would be the truncated distribution's: a few sequences sampled for the check, untruncated);
    with a rollout set of its own (placement.rollout),
    a few sequences sampled for the check from the next batch's prompts."""

    enable: bool = True
    num_sequences: int = 4  # per generation replica
    # Response tokens of each checked sequence the trainer recomputes (a prefix; at most the
    # rollout's): a few hundred tokens find a broken sync as surely as full-length responses,
    # and at 512-token responses the full-length check took 2.5 s of a 28 s step (1.5B, one
    # H200). 0: the whole response.
    max_new_tokens: int = 64
    # The run stops when the max over the checked tokens exceeds this; null: by the actor's
    # compute dtype and rollout.dtype (logprob_check_bound below).
    max_abs_diff: Optional[float] = None


@dataclass
class UserFunctionConfig:
    """A user's function in a Python file, called in the trainer on every rank:
    rollout.group_filter and rollout.generate_fn. Its file is imported first in a fresh
    interpreter (user_code.check_import) and the function's signature checked there, before any
    model is built.

    rollout.group_filter (rollout/group_filter.py): fn(group, **kwargs) -> bool | (bool,
    reason), deciding per prompt group keep or drop; `group` a PromptGroup (its dataset row,
    responses, scores, reward extras, finish reasons, lengths). It runs after
    algorithm.filter_groups' built-in filter, on the first training rank only, which sends its
    decisions to the others (what it raises there stops every rank). Dropped groups are
    refilled as algorithm.filter_groups.max_num_gen_batches allows.

    rollout.generate_fn (rollout/generate_fn.py): fn(engine, prompts, sampling, **kwargs) ->
    list[SampleOutput], sampling each prompt batch in place of one engine call (several calls,
    a second pass, tool turns), with a loss mask for the tokens that must not train."""

    path: Optional[str] = None  # a Python file
    name: Optional[str] = None  # the function in it
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to each call
    # Seconds the file may take to import (in a fresh interpreter first: user_code.check_import).
    import_timeout_s: float = 60.0


@dataclass
class ToolConfig:
    """A tool an agent loop's model may call (agent/tools.py): a function, or a class constructed
    once per sandbox worker with `kwargs` whose instances are called, in a user's Python file.
    The model calls it with JSON arguments checked against its OpenAI-style schema
    ({"type": "function", "function": {"name", "description", "parameters"}}): `schema` here,
    else the object's own `schema` attribute, else one derived from the signature's annotations
    and the docstring."""

    path: Optional[str] = None  # a Python file
    name: Optional[str] = None  # the function or class in it
    # A function: passed to each call beside the model's arguments (never in the schema);
    # a class: passed to its constructor.
    kwargs: dict[str, Any] = field(default_factory=dict)
    schema: dict[str, Any] = field(default_factory=dict)  # empty: the object's, or derived
    import_timeout_s: float = 60.0  # the start-up probe's limit (user_code.check_import)


@dataclass
class EnvironmentConfig:
    """An agent loop's environment (agent/environment.py): a class in a user's Python file,
    constructed with `kwargs` in a sandbox worker per trajectory, with reset(row) -> observation
    and step(action_text) -> (observation, reward, done)."""

    path: Optional[str] = None
    name: Optional[str] = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    import_timeout_s: float = 60.0


@dataclass
class SandboxConfig:
    """The worker processes that run tools and environments (agent/sandbox.py)."""

    num_workers: int = 4  # calls run concurrently up to this many
    timeout_s: float = 30.0  # per call or environment step; past it the worker is replaced
    max_memory_mb: Optional[int] = 4096  # each worker's address space (RLIMIT_AS); null: no cap
    max_output_chars: int = 16384  # a result longer than this is cut, and says so
    startup_timeout_s: float = 120.0  # a worker's interpreter start plus the files' imports


@dataclass
class AgentToolsConfig:
    """What an agent loop calls: tools, the parser of tool calls in the model's text, an
    environment, the sandbox they run in, and how observations become tokens
    (verl_mcore/agent/)."""

    tools: list[ToolConfig] = field(default_factory=list)
    # The tool-call parser: a built-in (agent/parsers.py PARSERS: "hermes") by name, or with a
    # path, a function fn(text, **kwargs) -> list[ToolCall | ParseError] in that file.
    parser: UserFunctionConfig = field(default_factory=lambda: UserFunctionConfig(name="hermes"))
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    # The chat-template role of a tool result's turn; "user" for templates without a tool role.
    observation_role: Literal["tool", "user"] = "tool"
    max_observation_tokens: int = 1024  # one observation turn's tokens; beyond: cut, and said so


@dataclass
class AgentLoopConfig(AgentToolsConfig, UserFunctionConfig):
    """rollout.agent_loop (agent/loop.py): a class in a Python file, subclassing
    verl_mcore.agent.loop.AgentLoop with `async def run(self, ctx, row, prompt_ids)`, that runs
    one multi-turn trajectory (model turns, tools, observations); constructed with `kwargs` once
    per trajectory. Or, without a path, a built-in loop by name (agent/builtin.py): `tools` (the
    model calls `tools`) or `environment` (a multi-turn `environment`). Every trajectory of a
    replica's batch runs at once over the engine (agent/runtime.py), and their SampleOutputs
    (loss mask 0 on observation tokens) are the batch, in place of one engine call; validation
    runs it too. Its file, the tools', the environment's and a parser's are imported first in a
    fresh interpreter and checked there, before any model is built. The tools and the
    environment (AgentToolsConfig's fields, here flat: rollout.agent_loop.tools, .environment,
    .sandbox, .parser, ...) are what a loop calls through `ctx.tools` (agent/toolbox.py)."""

    # Model turns per trajectory at most; a loop asking for one more ends with "length".
    max_turns: int = 8

    @property
    def configured(self) -> bool:
        """Whether an agent loop samples the batch."""
        return bool(self.path or self.name or self.kwargs)


@dataclass
class OffPolicyCorrectionConfig:
    """rollout.correction: per-token corrections for sampling with the engine's policy (pi_engine:
    older weights in one_step_off, another numeric path always) while the loss is that of the
    actor's recomputed log-probs (pi_old). Each reads the engine's log-probs, which the sampler
    then asks for, and the old-log-prob pass, which then always runs. Formulas, verl's and
    AReaL's names and where they differ: verl_mcore/algo/off_policy.py. rollout.tis_cap (the
    truncated IS weights) sits beside this section and combines with the masks; with `decoupled`
    it cannot (both set the weights)."""

    # Masked IS / IcePop: tokens whose ratio pi_old / pi_engine lies outside [1 / k, k] leave the
    # actor's loss and its normaliser (verl rollout_rs=token_k1, threshold k). null: off.
    token_mask: Optional[float] = None
    # Whole samples whose geometric-mean ratio exp(mean_t log(pi_old / pi_engine)) lies outside
    # [1 / k, k] leave the actor's loss and its normaliser (verl rollout_rs=seq_mean_k1,
    # formerly "geometric"). null: off.
    seq_mask: Optional[float] = None
    # AReaL's decoupled PPO objective: the PPO clip around the proximal policy (pi_old), each
    # token's loss weighted by pi_old / pi_engine (the behaviour policy's importance weight).
    decoupled: bool = False
    # decoupled: tokens whose weight exceeds this weigh 0, and stay in the normaliser (AReaL's
    # behav_imp_weight_cap). null: no cap.
    decoupled_cap: Optional[float] = None

    @property
    def enabled(self) -> bool:
        """Whether any correction of this section acts."""
        return self.token_mask is not None or self.seq_mask is not None or self.decoupled


@dataclass
class PartialRolloutConfig:
    """Partial (interruptible) rollouts, colocated (rollout/partial.py, partial_rollouts.py):
    each step keeps data.train_batch_size x (1 + over_sampling) prompt groups in flight
    (rounded up, at least one more than the batch), stops generating as soon as
    train_batch_size of them are finished (every sample stopped or hit the length limit),
    and continues the unfinished samples at the next step with the new weights, their tokens
    kept with the policy version of each. The long tail of response lengths then no longer
    holds up every step. The batch is off-policy: the actor recomputes its old log-probs, and
    rollout.tis_cap / rollout.correction weigh tokens against the engine's.
    rollout.mode=fully_async keeps such a pool on its rollout set (fully_async.py) with enable
    left false: it reads over_sampling, and its bound is rollout.max_staleness."""

    enable: bool = False
    over_sampling: float = 0.25  # extra prompt groups in flight, a share of the batch
    # A sample whose oldest token is more than this many policy versions older than the weights
    # about to sample is dropped and sampled again from its prompt: every trained token is at
    # most this many versions old. 0: nothing trains on older weights (unfinished samples start
    # over each step; only the over-sampling remains).
    max_staleness: int = 1


@dataclass
class RolloutConfig:
    engine: Literal["native", "vllm"] = "native"
    tensor_parallel_size: int = 1  # TP_g, generation layout; must divide training TP
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    # Sampling's seed (each batch draws from it, the batch index and the replica); null: derived
    # from trainer.seed (config/seeds.py). Set, it wins: the samples then stay the same while
    # trainer.seed varies the rest.
    seed: Optional[int] = None
    # Generation engine memory: fraction of the free GPU memory for the KV cache (GPU only). The
    # native engine's cache is paged: sequences take blocks as they grow, the samples of a prompt
    # share its prompt's blocks, and when the blocks run out the newest sequence is preempted and
    # recomputed later (rollout/preemptions). Where torch's flash kernel takes no block table
    # (torch 2.11), a block is a whole sequence: slots x the longest sequence, as before.
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 256  # sequences decoded together; finished slots are refilled
    keep_weights_buffer: bool = False  # keep the generation weight buffer between steps
    # The generation copy's linear weights (the native engine, rollout/fp8_weights.py). auto: the
    # actor's compute dtype (actor.dtype), as the trainer holds them. fp8: the four linear layers
    # of every decoder layer (QKV, attention output, MLP fc1 and fc2) in float8 e4m3 with one
    # fp32 scale per output channel, quantized as the repartition (or, in the training layout,
    # a requantization of the training weights) writes them; activations quantized per token;
    # embeddings, norms and the LM head stay in the actor's dtype. A decode step reads every
    # weight once, so its bytes nearly halve against bf16 (GEMMs by torch._scaled_mm on sm_89
    # and newer GPUs; elsewhere the same numbers by a slower dequantizing reference). The
    # engine then samples from a slightly different policy than the trainer's: the weight-sync
    # check's default bound widens (rollout.logprob_check.max_abs_diff), and rollout.tis_cap or
    # rollout.correction weigh the difference; rollout/engine_vs_trainer_logp_diff reports it.
    dtype: Literal["auto", "fp8"] = "auto"
    # sync: each step trains on responses sampled with its own weights. one_step_off (needs
    # placement.rollout): the rollout set samples the batch of step t + max_staleness while the
    # actor set trains step t, with the weights of t - 1, so generation and training overlap and a
    # sample lags the policy it trains by up to max_staleness versions.
    # fully_async (needs placement.rollout and the native engine; fully_async.py): the rollout
    # set keeps prompt groups in flight (rollout.partial.over_sampling extra) across weight
    # updates, continues their samples with each new version instead of restarting them, and
    # hands over each batch of train_batch_size finished groups while the trainers train on the
    # previous one; a sample holding a token more than max_staleness versions older than the
    # weights it trains is sampled again.
    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    # one_step_off: batches sampled ahead (policy versions a sample lags); fully_async: the
    # versions a trained token may lag (1 restarts unfinished samples at each update; 2 and more
    # continue them)
    max_staleness: int = 1
    # Truncated importance sampling against the engine's own log-probs (verl's
    # tis_imp_ratio_cap): each token's policy loss is weighted by min(pi_old / pi_engine, tis_cap),
    # pi_old the actor's recomputed log-probs. null: off.
    tis_cap: Optional[float] = None
    correction: OffPolicyCorrectionConfig = field(default_factory=OffPolicyCorrectionConfig)
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    logprob_check: LogprobCheckConfig = field(default_factory=LogprobCheckConfig)
    group_filter: UserFunctionConfig = field(default_factory=UserFunctionConfig)
    generate_fn: UserFunctionConfig = field(default_factory=UserFunctionConfig)
    agent_loop: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    # Validation sampling
    val_n: int = 1
    val_temperature: float = 0.0  # 0: greedy

    @property
    def weighs_engine_log_probs(self) -> bool:
        """Whether the actor's loss reads the engine's log-probs: rollout.tis_cap or a
        rollout.correction (the sampler asks the engine for them, the old-log-prob pass runs)."""
        return self.tis_cap is not None or self.correction.enabled


@dataclass
class CustomClassConfig:
    path: Optional[str] = None  # a Python file
    name: Optional[str] = None  # the class or function in it


@dataclass
class CustomClassKwargsConfig(CustomClassConfig):
    # Passed to the class's constructor, once per scoring process (not to each call).
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    # What to do with a prompt longer than max_prompt_length (in tokens, after the chat template).
    truncation: Literal["error", "filter", "truncate_left", "truncate_right"] = "error"
    on_bad_row: Literal["error", "skip"] = "error"
    apply_chat_template: bool = True
    # OpenAI-style tool schemas shown to the model in every prompt (data/chat.py: the
    # template's tools=, else a system message in the hermes format). Empty: those of
    # rollout.agent_loop.tools, when an agent loop has tools.
    tools: list[dict[str, Any]] = field(default_factory=list)
    train_batch_size: int = 8  # prompts per step, global
    val_batch_size: Optional[int] = None  # default: all validation prompts in one batch
    shuffle: bool = True
    # The prompt order (and a custom dataset's max_samples choice); null: derived from
    # trainer.seed (config/seeds.py). Set, it wins. A resume keeps it (config/resume.py).
    seed: Optional[int] = None
    # A subclass of verl_mcore.data.RLHFDataset overriding read_file or verl's
    # _read_files_and_tokenize (data/dataset.py).
    custom_cls: CustomClassConfig = field(default_factory=CustomClassConfig)
    # Seconds data.custom_cls's file may take to import. It is imported first in a fresh
    # interpreter (user_code.py: check_import), so a file that blocks at import (a sleep, a
    # network call, input()) or exits fails naming the file and the line it was on, instead of
    # hanging every rank. Its own key, not reward.import_timeout_s: the two files are different
    # code with different imports, each tuned where it is configured.
    import_timeout_s: float = 60.0
    # Seconds building the datasets may take, train and val together: reading, checking and
    # tokenising, a data.custom_cls's read_file / _read_files_and_tokenize included. Past it the
    # run fails naming the class, its file and where it was stuck, instead of hanging before
    # step 1. Every rank reads, and the ranks done first wait for the others in a collective
    # that gives up after trainer.collective_timeout_s, so it must be below that; null: 3/4 of
    # trainer.collective_timeout_s (1350 s at its default).
    read_timeout_s: Optional[float] = None

    def get(self, key: str, default: Any = None) -> Any:
        """`config.get("key", default)`, as verl's custom datasets read their DictConfig: the
        field's value, or `default` for a key this config does not have."""
        return getattr(self, key, default)


@dataclass
class RewardSourceConfig:
    name: str = "rule"
    weight: float = 1.0
    # environment: the reward the sampling gave each trajectory (an agent loop's run result, an
    # environment's: rollout.agent_loop; or a generate function's SampleOutput.reward); a
    # trajectory without one fails that sample's score (reward.fallback_score, counted)
    type: Literal["rule", "custom", "reward_model", "environment"] = "rule"
    # custom: Python file; reward_model: HF directory, Hub id `org/name` (as model.path) or
    # dist checkpoint
    path: Optional[str] = None
    # custom: a function (called per sample with `kwargs`) or a class (constructed once per
    # scoring process with `kwargs`; a per-sample `score` / `__call__` or a batch
    # `compute_reward(batch)`: reward/custom.py)
    function: Optional[str] = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    # reward_model only. The model runs forward only (engine/reward_model.py) where
    # placement.reward_model puts it (default: with the actor, at parallel.*'s layout); its
    # micro-batches default to the actor's settings.
    dtype: Dtype = "bf16"
    tokenizer: Optional[str] = None  # default: `path` (a dist checkpoint: its hf_config/)
    # reward_model only: revision of a Hub id in `path` (and `tokenizer` when the same id), as
    # model.revision
    revision: Optional[str] = None
    micro_batch_size: Optional[int] = None
    max_tokens_per_microbatch: Optional[int] = None


@dataclass
class OverlongBufferConfig:
    # DAPO's soft overlong punishment, verl's reward_model.overlong_buffer and its formula: a
    # response longer than data.max_response_length - len tokens (its stop token counted) loses
    # (length - (max_response_length - len)) / len * penalty_factor of its score, up to
    # penalty_factor at max_response_length (algo/overlong.py). Training scores only.
    enable: bool = False
    len: Optional[int] = None  # the buffer's tokens (DAPO's L_cache); needed with enable
    penalty_factor: float = 1.0  # the penalty at max_response_length (verl's default is 0.0)


@dataclass
class RewardConfig:
    # One user function replacing the built-in dispatch (score(data_source, response, gt, extra)).
    custom_fn: CustomClassConfig = field(default_factory=CustomClassConfig)
    custom_fn_kwargs: dict[str, Any] = field(default_factory=dict)
    # Or one user class in its place, constructed once per scoring process with `kwargs`: a
    # per-sample `score(data_source, response, ground_truth, extra_info)` (or `__call__`) or a
    # batch `compute_reward(batch) -> B scores` (reward/custom.py). Not together with custom_fn.
    custom_cls: CustomClassKwargsConfig = field(default_factory=CustomClassKwargsConfig)
    # How the built-in GSM8K, MATH and DAPO scorers compare answers (reward/builtin.py):
    #   verl         verl 0.9.1's scorers exactly (`#### 3.50` is wrong for 3.5 there). The default,
    #                because the data_source names are verl's: a dataset prepared for verl and a
    #                recipe copied from it must get verl's rewards, or its curves and published
    #                numbers do not reproduce, and nothing would say why.
    #   lenient      answers equal in value or up to formatting are right (`#### 3.50`,
    #                `\boxed{12 square inches}` for 12); every difference from verl is listed in the
    #                scorer modules' docstrings (reward/gsm8k.py, math_answers.py, math_dapo.py).
    #   math_verify  MATH sources checked by the math-verify library, as verl's math_verify.py
    #                does (pip install 'verl_mcore[math]'); GSM8K and DAPO sources as `verl`.
    math_compat: Literal["verl", "lenient", "math_verify"] = "verl"
    # Route by a column: value -> scorer name (a built-in data_source or a source name). Logs
    # reward/route/<value>/mean and /count over the whole batch (reward/manager.py).
    route_by: Optional[str] = None
    routes: dict[str, str] = field(default_factory=dict)
    default_route: Optional[str] = None
    # Weighted sum of several sources; empty: one rule-based source.
    sources: list[RewardSourceConfig] = field(default_factory=list)
    # Scoring processes per rank (reward/pool.py). 0: score in the trainer process, without
    # timeouts, memory cap or crash isolation: only for trusted, well-behaved code.
    num_workers: int = 2
    timeout_s: float = 10.0  # per sample, in the workers; > 0
    fallback_score: float = 0.0
    # Seconds each reward file (reward.custom_fn, custom reward.sources) may take to import; it is
    # imported first in a fresh interpreter, so a blocking or exiting import fails naming the file.
    import_timeout_s: float = 60.0
    # Address-space cap of each scoring worker (RLIMIT_AS), in MiB; null: no cap. A scorer going
    # over it gets a MemoryError: a failed score, logged with its sample. It counts virtual
    # memory, so libraries that reserve large ranges (CUDA, many-threaded BLAS) need a high cap.
    # Needs num_workers >= 1: a cap on the trainer process would cap the trainer.
    max_memory_mb: Optional[int] = None
    # Stop the run when more than this fraction of a batch's samples failed to score (raised,
    # timed out, crashed their worker, returned a non-number or a non-finite number), naming the
    # first failure. 1.0: never stop; 0.0: stop at the first failure.
    max_failed_fraction: float = 0.5
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's algorithm.filter_groups, rollout/group_filter.py): a step
    samples generation batches of prompts until data.train_batch_size prompt groups passed the
    group filters, then trains on the first train_batch_size of them (the surplus is dropped, as
    verl does). `enable` turns on the built-in filter; max_num_gen_batches and
    on_max_gen_batches bound the refill of any group filter, rollout.group_filter's too."""

    # Drop the prompt groups whose `metric` is the same for every sample (verl: std == 0),
    # whose samples would all get a zero GRPO advantage; a group of one sample is kept.
    enable: bool = False
    # What is compared within a group: score (= seq_reward: the sample's total reward score),
    # seq_final_reward (the same; refused with algorithm.use_kl_in_reward), acc, or any reward
    # extra, bare (`acc`) or with its source (`rule/acc`). `acc` with one reward source is its
    # scorer's "acc" where the scorer returns one, else the sample's score (verl's rule).
    metric: str = "acc"
    # Generation batches a step may sample; 0: no limit (verl reads a negative value so too; here
    # it is refused, naming the key).
    max_num_gen_batches: int = 0
    # When max_num_gen_batches were sampled without a full batch: "error" stops the run with a
    # message naming the counts (verl's behaviour, so a copied DAPO recipe fails the same way, and
    # no step trains on a batch other than the configured size unless asked to); "train" trains
    # on the groups kept so far, with a warning and rollout/filter/short_batch = 1.
    on_max_gen_batches: Literal["error", "train"] = "error"


@dataclass
class AlgorithmConfig:
    adv_estimator: Literal[
        "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"
    ] = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    whiten_advantages: bool = True  # GAE: masked whitening over the batch's valid tokens
    use_kl_in_reward: bool = False
    kl_penalty: KLKind = "k1"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    lr_warmup_steps: int = 0


@dataclass
class LoRAConfig:
    """Low-rank adapters on the linear layers (models/lora.py), peft's LoRA: each targeted linear
    computes W·x + (alpha / r)·B·A·dropout(x); only A and B train. On the actor the reference
    is the same model with its adapters off (no second copy of the weights)."""

    enable: bool = False
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # Hugging Face names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj) or
    # "all-linear"; a part of a fused megatron layer adapts only its rows (q_proj alone: the q
    # rows of linear_qkv). "lm_head" (the output layer, actor only, untied models) is apart from
    # "all-linear", as in peft: [all-linear, lm_head] adapts both.
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # peft's init: true = A kaiming-uniform, B = 0 (step 0 equals the base model); "gaussian" =
    # A normal(0, 1/r), B = 0; false = both random (tests only: step 0 differs from the base).
    init_lora_weights: Union[bool, Literal["gaussian"]] = True
    lr: Optional[float] = None  # the adapters' learning rate; null: the role's optim.lr
    init_from: Optional[str] = None  # a peft adapter directory to start from (adapter_config.json)


@dataclass
class ActorConfig:
    # Compute dtype (weights, activations); master weights and optimizer state are fp32 always.
    dtype: Dtype = "bf16"
    ppo_mini_batch_size: int = 8  # prompts per optimizer step, global
    # Micro-batches (module docstring): null and null = a token budget the planner derives.
    micro_batch_size_per_gpu: Optional[int] = None  # samples per forward/backward per rank (padded)
    max_tokens_per_microbatch: Optional[int] = None  # token budget per rank (packed path)
    ppo_epochs: int = 1
    policy_loss: Literal["ppo", "gspo", "reinforce", "gpg"] = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLKind = "low_var_kl"
    recompute_activations: bool = False
    # The old-log-prob forward pass before the update. "auto" skips it when the update is one
    # on-policy optimizer step (ppo_epochs = 1, one mini-batch = the whole batch) and no in-reward
    # KL reads the old log-probs: the weights that sampled are the weights being updated, so the
    # update's own log-probs, detached, are the old ones (ratio exactly 1, as verl's on-policy
    # path). "always" runs the pass anyway (e.g. to log actor/old_entropy).
    recompute_old_log_probs: Literal["auto", "always"] = "auto"
    # DAPO's overlong filtering: samples cut at data.max_response_length (finish reason "length")
    # are left out of the actor's loss and of its normaliser, in every loss_agg_mode. The critic
    # and the advantages (GRPO's group statistics) still see them (algo/overlong.py).
    mask_truncated_samples: bool = False
    # Routing replay of a mixture-of-experts actor (models/router_replay.py). "rollout": the
    # native engine records each response token's experts per layer (routed_experts, in the
    # trajectory), and the old-log-prob, reference and update forward passes route each token
    # to them; the gates are recomputed from the trainer's router, which keeps its gradients.
    # Prompt positions route as the trainer's routers choose. actor/router_replay_mismatch: the
    # share of token-layer decisions where the trainer would have chosen other experts.
    router_replay: Literal["off", "rollout"] = "off"
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


# The weight-sync check's default bound on max |engine - trainer| log-prob by the actor's compute
# dtype (the engine generates in it too). fp32: the two forward passes agree to ~1e-5, so 0.5
# trips only on wrong weights. bf16 / fp16: a trained model's logits are large (|z| ~ 20-30,
# where a bf16 step is 0.125) and the engine's decode kernels round differently from the
# trainer's packed forward, layer after layer: SmolLM2-135M-Instruct on an H100 showed up to
# 0.62 and 0.85 (mean 0.03) over ~60 sampled tokens and stopped GRPO runs at 0.5, which the
# random-weight models (small logits) never reached (bench/RESULTS.md 2026-12-07). Weights that
# do not match (a wrong shard, a missed update) are off by whole nats on most tokens.
LOGPROB_CHECK_BOUND = {"fp32": 0.5, "bf16": 2.0, "fp16": 2.0}
# Added to it with rollout.dtype=fp8. Where it comes from: a quantized element is off by at most
# 2^-4 of itself (e4m3's 3 mantissa bits, ops/fp8.py), so each of the ~4 x layers GEMMs between
# the embedding and the logits computes with both operands a few percent off, errors that no
# per-GEMM bound carries usefully through the layers. A token's log-prob moves by at most twice
# the largest logit change (|d log p_t| <= |dz_t| + |d logsumexp z| <= 2 max |dz|), but the
# logit changes themselves are only known by measuring: bench/fp8_logprob_gap.py on the
# real-model fixture (SmolLM2-135M-Instruct, fp32 trainer, CPU, 16 chat prompts x 2 seeds x up to
# 64 sampled tokens, 2026-12-07): FP8 vs trainer max 2.31, p99.9 1.60, p99 1.10, mean 0.20 over
# 1,706 tokens (weights alone in FP8: mean 0.16; activations alone: 0.12); the same engine in
# fp32: max 3e-5. 3.0 keeps an fp32 actor's bound (3.5) 1.5x above the measured max and a bf16
# actor's (5.0) 1.6x above bf16's measured 0.85 plus FP8's 2.31. The max of a heavy tail grows with
# the tokens checked: a GPU measurement at bf16 (bench/RESULTS.md, owed) should confirm or
# replace it. Under FP8 the max is a weaker detector of a broken sync than under bf16 (the
# mean, 0.20 here, separates better).
FP8_LOGPROB_ALLOWANCE = 3.0


def logprob_check_bound(cfg: "Config") -> float:
    """rollout.logprob_check.max_abs_diff, or its default for the actor's dtype, widened by
    FP8_LOGPROB_ALLOWANCE for an FP8 generation copy (rollout.dtype=fp8)."""
    bound = cfg.rollout.logprob_check.max_abs_diff
    if bound is not None:
        return bound
    fp8 = FP8_LOGPROB_ALLOWANCE if cfg.rollout.dtype == "fp8" else 0.0
    return LOGPROB_CHECK_BOUND[cfg.actor.dtype] + fp8


def padded_micro_batches(role: "ActorConfig | CriticConfig") -> bool:
    """The role runs the padded path: micro_batch_size_per_gpu set and no token budget (a
    budget, when set, wins)."""
    return role.max_tokens_per_microbatch is None and role.micro_batch_size_per_gpu is not None


def planner_micro_batches(role: "ActorConfig | CriticConfig") -> bool:
    """Neither micro-batch setting given: the planner derives the role's token budget."""
    return role.max_tokens_per_microbatch is None and role.micro_batch_size_per_gpu is None


@dataclass
class ReferenceConfig:
    dtype: Dtype = "bf16"
    # Keep the weights in pinned host memory between reference passes: they come to the GPU for
    # the reference log-probs only (one host-to-device copy a step; README: what it costs).
    offload_params: bool = False


@dataclass
class CriticConfig:
    # Compute dtype of the critic's model, as actor.dtype: with bf16 (the default) the weights and
    # activations are bf16 while the master weights and Adam state stay fp32 (megatron's mixed
    # precision) and the value head and value loss compute in fp32. fp32 is full fp32 training
    # (README: what it costs).
    dtype: Dtype = "bf16"
    ppo_mini_batch_size: Optional[int] = None  # default: actor's
    micro_batch_size_per_gpu: Optional[int] = None  # as actor's: null and null = planner's budget
    max_tokens_per_microbatch: Optional[int] = None
    ppo_epochs: Optional[int] = None  # default: actor's
    cliprange_value: float = 0.5
    warmup_steps: int = 0  # steps that update only the critic
    recompute_activations: bool = False
    # The forward-only values pass before the update. "auto" skips it when the update is one
    # optimizer step (ppo_epochs = 1, one mini-batch = the whole batch): its forward passes run on
    # the weights before the update, so their values, detached, are the rollout-time values
    # (engine/critic.py). "always" runs the pass anyway (verl's order).
    recompute_values: Literal["auto", "always"] = "auto"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class CheckpointConfig:
    save_every: int = 0  # steps; 0: only at the end and on preemption
    keep_last: int = 2  # newest complete checkpoints kept; 0: keep every checkpoint
    resume: Literal["auto", "never"] = "auto"
    # Resume from this checkpoint instead of the newest, once: later starts of the run (requeues)
    # continue from its own newer checkpoints (RUN_DIR/checkpoints/load_path_consumed.json).
    load_path: Optional[str] = None
    async_save: bool = False
    save_optimizer: bool = True


@dataclass
class ValMetricFnConfig(CustomClassConfig):
    # Seconds the file may take to import (in a fresh interpreter first: user_code.check_import).
    import_timeout_s: float = 60.0
    # Seconds one call (one data source of one validation) may take; past it the validation
    # fails naming the function instead of every rank waiting forever.
    timeout_s: float = 600.0


@dataclass
class TrainerConfig:
    total_steps: int = 1
    run_dir: str = "runs/default"
    project: str = "verl_mcore"
    experiment_name: str = "default"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    val_every: int = 0  # steps; 0: no validation
    val_before_train: bool = False
    # What validation logs besides score/mean@n and pass@n (val_metrics.py has the details):
    # text metrics against each row's reward_model.ground_truth, by name: exact_match, rouge,
    # bleu, or any metric of the HF `evaluate` library; keyword arguments per metric name; a
    # function fn(responses, references, rows) -> {name: float} from a Python file.
    val_metrics: list[str] = field(default_factory=list)
    val_metric_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    val_metric_fn: ValMetricFnConfig = field(default_factory=ValMetricFnConfig)
    # pass@n counts a prompt whose best sample scores at least this.
    val_pass_threshold: float = 1.0
    # Write this many prompt / response / score / reference rows of each validation to
    # RUN_DIR/val_generations/step_<step>.jsonl; 0: none.
    log_val_generations: int = 0
    # The run's one seed: every random stream derives its own from it (config/seeds.py):
    # sampling and the prompt order unless rollout.seed / data.seed are set, new heads (the
    # critic's value head), LoRA adapters, dropout, torch / numpy / Python generators.
    seed: int = 42
    on_nonfinite: Literal["stop", "skip"] = "stop"
    # on_nonfinite=skip: this many optimizer steps of one role skipped in a row for a non-finite
    # gradient norm stop the run (a run whose every update is skipped trains nothing).
    max_consecutive_skips: int = 3
    collective_timeout_s: float = 1800.0
    # Where the models compute: "auto" is cuda when torch sees a GPU, else cpu. cpu runs the
    # CPU path (gloo, megatron-core through distributed/cpu_compat.py) under a CUDA build of
    # torch as well; the configured device, not CUDA's presence, decides (utils/device.py).
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # Move the actor's and critic's optimizer state and gradient buffers to (pinned) host memory
    # before generation; each comes back only for its own update, so generation, scoring and the
    # other role's update get that memory. "auto": only when the planner finds that some phase
    # would not fit with them kept on the GPU
    # (plan.choose_offload, with this GPU's memory); never on CPU, where there is nothing to free.
    offload_between_phases: Union[bool, Literal["auto"]] = "auto"


@dataclass
class RoleSetConfig:
    """The ranks one role runs on, and its layout there (placement.<role>).

    A bare list or string is `ranks`: `critic: [4, 5]` or `critic: "4-5"`. Ranks are global
    (node n's GPU g is rank n × GPUs per node + g), so on one node they are the GPU indices;
    `nodes` names whole nodes instead (`nodes: "2-3"`: every GPU of nodes 2 and 3)."""

    ranks: Union[list[int], str, None] = None
    nodes: Union[list[int], str, None] = None
    # The role's layout inside its set (DP = set size / (TP × PP × CP)); null: parallel.*'s.
    # The actor's layout is always parallel.* (set it there).
    tensor_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None


RoleSet = Union[RoleSetConfig, list[int], str, None]


@dataclass
class PlacementConfig:
    """Which ranks run each role (config/placement.py). Left out, a role runs where the
    actor runs; with nothing set every role runs on every rank (colocated, time-shared). Sets
    are disjoint or identical; every rank runs some role."""

    actor: RoleSet = None  # with its rollout engine; null: every rank
    reference: RoleSet = None
    critic: RoleSet = None
    reward_model: RoleSet = None  # every reward model of reward.sources
    # The generation engine on ranks of its own (rollout.tensor_parallel_size ranks a replica),
    # apart from every training role; the actor's weights reach it point to point after each
    # update (rollout/cross_set.py). null: the engine runs on the actor's ranks.
    rollout: RoleSet = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @classmethod
    def load(cls, path: Optional[str] = None, overrides: Optional[list[str]] = None) -> "Config":
        """YAML file (optional) + `a.b.c=value` overrides -> a type-checked Config.

        Cross-field checks that need the world size or the model shape are in
        `verl_mcore.config.validate`; this only checks keys, types and single fields. `path`
        may be the bare name of a shipped config (`quickstart`), and the input files it names
        are found among the shipped ones when they are not in the current directory
        (verl_mcore/shipped.py has the rule).
        """
        tree = load_yaml(shipped.config_file(path)) if path else {}
        for text in overrides or []:
            keys, value = parse_override(text)
            apply_override(tree, keys, value)
        cfg = from_dict(cls, tree)
        shipped.resolve_paths(cfg)
        return cfg

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(to_dict(self), sort_keys=False, default_flow_style=False)

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def critic_values_pass(self) -> bool:
        """Whether the critic's forward-only values pass runs before its update: unless the
        update is one optimizer step, whose own forward passes give the values
        (critic.recompute_values, engine/critic.py). A critic placed on ranks of its own
        (placement.critic) always runs it: the actor set then takes the values and updates the
        actor while the critic set updates the critic."""
        c, a = self.critic, self.actor
        one_step = ((c.ppo_epochs or a.ppo_epochs) == 1
                    and (c.ppo_mini_batch_size or a.ppo_mini_batch_size) == self.data.train_batch_size)
        placed = self.placement.critic is not None and self.placement.critic != self.placement.actor
        return self.uses_critic and (c.recompute_values == "always" or not one_step or placed)
