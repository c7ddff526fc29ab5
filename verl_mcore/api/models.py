"""The models of the Python API: `Policy`, `Critic`, `RewardModel`, made `from_pretrained` by the
builders the trainer uses (verl_mcore/build.py), at the process's parallel layout (session.py).

    policy = Policy.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct", tensor_parallel_size=2,
                                    dtype="bf16", lr=1e-6)
    critic = Critic.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct", lr=1e-5)      # PPO (gae)
    judge = RewardModel.from_pretrained("org/reward-model", policy=policy, weight=1.0)
    ...
    policy.save_pretrained("out/hf")       # an HF directory transformers loads

A path is an HF directory or a Hub id (org/name: read through huggingface_hub's cache,
downloaded once per node, models/hub.py). Every rank makes the same calls (SPMD); each rank
builds its TP/PP shard of each model, and no rank loads a whole model.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from verl_mcore import build
from verl_mcore.api import session as sess
from verl_mcore.config import ConfigError, ModelShape
from verl_mcore.convert_hf.convert import DEFAULT_MAX_SHARD_BYTES, HFDirWriter
from verl_mcore.distributed.agree import all_ranks_agree, raised_on_every_rank
from verl_mcore.distributed.launch import detect_launch
from verl_mcore.engine.actor import Actor
from verl_mcore.engine.critic import Critic as CriticRole
from verl_mcore.models.hf_config import generation_eos_ids, read_hf_arch
from verl_mcore.models.hf_weights import check_weight_files
from verl_mcore.rollout.vllm_engine import hf_weight_stream
from verl_mcore.tiny_model import ensure_tiny_model

# dtype names a transformers user writes, as the config spells them.
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp32": "fp32",
           "bf16": "bf16", "fp16": "fp16"}


def micro_batched(cfg, info):
    """`cfg` with the token budget the Trainer would run for each role that sets no micro-batch
    size (build.resolve_micro_batches): the planner's on a GPU, from this config's lengths and
    batch sizes, so a RolloutWorker's or an update's config gets a budget that holds its
    sequences. Collective (the job's smallest GPU): every rank calls it alike."""
    world = sess.current().world
    return build.resolve_micro_batches(cfg, info, world, world)[0]


def dtype_name(dtype: Any, who: str) -> Optional[str]:
    """"fp32" / "bf16" / "fp16" from those names, "float32"-style names or a torch.dtype."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"{who}: dtype={dtype!r}; choose fp32, bf16 or fp16 (or torch.float32, "
                          "torch.bfloat16, torch.float16)")
    return _DTYPES[name]


def _model_keys(path: str, tokenizer: Any, revision: Optional[str],
                trust_remote_code: Optional[bool]) -> dict[str, Any]:
    """model.* keys of a from_pretrained call; a tokenizer object is handed over separately."""
    return {"model.path": os.fspath(path), "model.revision": revision,
            "model.tokenizer": os.fspath(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else None,
            "model.trust_remote_code": trust_remote_code}


def _layout_keys(tp, pp, tp_g) -> dict[str, Any]:
    return {"parallel.tensor_model_parallel_size": tp, "parallel.pipeline_model_parallel_size": pp,
            "rollout.tensor_parallel_size": tp_g}


def _read_model(cfg, who: str, session, tokenizer: Any):
    """The checks build.build_inputs makes of a model before it is built (weight headers, the
    lengths and heads against config.json, the tokenizer), on every rank, a failure on any rank
    raised on all; then its build.ModelInfo. A tokenizer object replaces the directory's."""
    build.fetch_for_run(cfg)  # a Hub id: downloaded once per node, then the same snapshot everywhere

    def read():
        try:
            hf_dir = build.model_dir(cfg)
            sess.check(cfg, who, session.world, ModelShape.from_hf_dir(hf_dir))
            if cfg.model.checkpoint is None:
                check_weight_files(hf_dir)
                build.check_model_tensors(hf_dir, read_hf_arch(hf_dir),
                                          "critic" if who.startswith("Critic") else "actor")
            if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
                return build.load_model_info(cfg)
            arch = read_hf_arch(hf_dir)
        except ConfigError:
            raise
        except (ValueError, OSError) as e:  # what a user's input raises; the rest are our bugs
            raise ConfigError(f"{who}: {e}") from e
        if len(tokenizer) > arch.vocab_size:
            raise ConfigError(f"{who}: the tokenizer given has {len(tokenizer)} ids but the model "
                              f"{arch.vocab_size} embeddings (vocab_size): ids past them would "
                              "read padding rows; give the model's own tokenizer")
        return build.ModelInfo(arch, tokenizer, hf_dir, cfg.model.checkpoint,
                               generation_eos=generation_eos_ids(hf_dir))

    return all_ranks_agree(read, f"reading the model of {who}")


def _layout_error(who: str, dp: Optional[int], tp: int, pp: int) -> None:
    """data_parallel_size is what the ranks leave: world / (TP x PP); a different one is a
    launch of another size, said before anything starts."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else detect_launch().world_size
    if dp is not None and dp * tp * pp != world:
        raise ConfigError(
            f"{who}: data_parallel_size={dp} with tensor_parallel_size={tp} x "
            f"pipeline_parallel_size={pp} needs {dp * tp * pp} ranks, but this job has {world} "
            f"(which gives data_parallel_size={world // (tp * pp) if world % (tp * pp) == 0 else 'none'}"
            f"); launch {dp * tp * pp} ranks (torchrun --nproc-per-node ...) or leave "
            "data_parallel_size=None")


class Policy:
    """The actor: a megatron-core GPTModel with its optimizer, at the process's TP x PP x DP.

    cfg      the Config of its settings (model, parallel, actor dtype / optimizer / micro-batches)
    info     build.ModelInfo: the HF architecture, the tokenizer, the HF directory
    actor    engine.actor.Actor: log-probs and the PPO update (a PPOTrainer runs it)
    version  the number of actor updates so far (experiences remember the one that sampled)
    """

    def __init__(self, cfg, tree: dict, info, actor, session, own_tokenizer: bool):
        self.cfg, self.info, self.actor, self.version = cfg, info, actor, 0
        self._tree, self._session, self._own_tokenizer = tree, session, own_tokenizer

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, *, tensor_parallel_size: int = 1,
                        pipeline_parallel_size: int = 1, data_parallel_size: Optional[int] = None,
                        rollout_tensor_parallel_size: int = 1, dtype: Any = None,
                        tokenizer: Any = None, lr: Optional[float] = None,
                        revision: Optional[str] = None, trust_remote_code: Optional[bool] = None,
                        seed: Optional[int] = None, overrides: Sequence[str] = ()) -> "Policy":
        """An HF causal LM (directory or Hub id) as the policy. tokenizer: one you already have
        (an HF tokenizer object), or a directory / Hub id; default: the model's own.
        dtype: compute dtype of the policy and of the reference made from it (fp32, bf16,
        fp16; default bf16). lr: Adam's learning rate (default 1e-6). rollout_tensor_parallel_size:
        the generation layout's TP (divides tensor_parallel_size; weights are re-sliced into it
        for each generation). overrides: more keys of the Policy's
        ("actor.optim.weight_decay=0.0", "actor.micro_batch_size_per_gpu=4", "model.checkpoint=
        DIST_CKPT", ...; session.OWNED lists them). An LR schedule other than constant decays
        over trainer.total_steps optimizer steps."""
        who = "Policy.from_pretrained"
        _layout_error(who, data_parallel_size, tensor_parallel_size, pipeline_parallel_size)
        dtype = dtype_name(dtype, who)
        tree = sess.settings(who, {
            **_model_keys(path_or_hub_id, tokenizer, revision, trust_remote_code),
            **_layout_keys(tensor_parallel_size, pipeline_parallel_size,
                           rollout_tensor_parallel_size),
            "actor.dtype": dtype, "reference.dtype": dtype, "actor.optim.lr": lr,
            "trainer.seed": seed}, overrides)
        cfg = sess.config_of(tree)
        session = sess.session_for(cfg, who)
        ensure_tiny_model(cfg.model, session.local_rank)  # model.make_tiny_if_missing
        info = _read_model(cfg, who, session, tokenizer)
        cfg = micro_batched(cfg, info)
        with build.role_seed(cfg.trainer.seed, "actor"):  # as the Trainer builds it
            actor = build.build_actor(cfg, session.groups, info)
        actor.engine.skip_nonfinite = cfg.trainer.on_nonfinite == "skip"
        own = tokenizer is not None and tokenizer != path_or_hub_id
        return cls(cfg, tree, info, actor, session, own)

    @property
    def tokenizer(self):
        return self.info.tokenizer

    def actor_for(self, cfg):
        """The actor role of this policy's model and optimizer for `cfg` (a RolloutWorker's or
        an update's: its loss settings, mini-batches and sampling temperature), as
        build.build_actor makes it."""
        a = micro_batched(cfg, self.info).actor
        return Actor(self.actor.engine, a, mini_batch_size=a.ppo_mini_batch_size * cfg.rollout.n,
                     temperature=cfg.rollout.temperature or 1.0,
                     norm_len=float(cfg.data.max_response_length))

    def save_pretrained(self, out_dir: str, *, overwrite: bool = False,
                        max_shard_bytes: Optional[int] = None) -> str:
        """Write the policy's current weights as an HF directory (safetensors shards, config.json,
        tokenizer) that transformers' AutoModelForCausalLM loads. Collective: every rank calls
        it. Every layer's TP shards are gathered as for generation (the repartition into the
        generation layout, then each tensor all-gathered in the generation TP group and renamed
        to its HF name: rollout/vllm_engine.hf_weight_stream); rank 0 writes, one shard at a
        time, on its own filesystem. Returns the directory."""
        s, groups = self._session, self._session.groups
        out_dir = os.path.abspath(out_dir)
        writer = None

        def open_dir():
            nonlocal writer
            if os.path.exists(out_dir) and not overwrite:
                raise FileExistsError(f"Policy.save_pretrained: {out_dir} exists; pass "
                                      "overwrite=True to replace it (every file in it is removed)")
            writer = HFDirWriter(out_dir, self.info.hf_dir, force=overwrite,
                                 max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
                                 inputs={"model.path": self.info.hf_dir,
                                         "model.checkpoint": self.info.checkpoint})

        all_ranks_agree(lambda: open_dir() if s.rank == 0 else None, f"opening {out_dir}")
        model, repartitioner = build.build_generation_model(self.cfg, groups, self.info, self.actor)
        try:
            if repartitioner is not None:
                repartitioner.run()  # every rank: its TP_g shard of every layer
            with raised_on_every_rank(f"saving the policy to {out_dir}"):
                try:
                    if groups.gen_dp_rank == 0:  # rank 0's replica; the others hold the same
                        _write_stream(hf_weight_stream(model, self.info.arch, groups.gen_tp), writer)
                    if writer is not None:
                        writer.commit(self.info.tokenizer if self._own_tokenizer else None)
                except BaseException:
                    if writer is not None:
                        writer.abort()
                    raise
        finally:
            if repartitioner is not None:
                repartitioner.buffer.release()
        return out_dir


def _write_stream(stream, writer) -> None:
    """Every bucket of `stream` into `writer` (None: consumed only). The stream is collective
    over its TP group, so a failed write still consumes it all before raising: the group's other
    ranks would otherwise wait in its next all-gather."""
    failure = None
    for bucket in stream:
        if writer is not None and failure is None:
            try:
                writer.add(bucket)
            except Exception as e:  # noqa: BLE001 - raised below, once the stream is drained
                failure = e
    if failure is not None:
        raise failure


class Critic:
    """A value model (algorithm "gae"): the HF model's body with a fresh value head, its own
    optimizer, at the process's layout. cfg, info, critic (engine.critic.Critic) as Policy's."""

    def __init__(self, cfg, tree: dict, info, critic):
        self.cfg, self.info, self.critic, self._tree = cfg, info, critic, tree

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, *, dtype: Any = None, lr: Optional[float] = None,
                        tokenizer: Any = None, revision: Optional[str] = None,
                        tensor_parallel_size: Optional[int] = None,
                        pipeline_parallel_size: Optional[int] = None,
                        overrides: Sequence[str] = ()) -> "Critic":
        """dtype: its compute dtype (default bf16; master weights and Adam state are fp32);
        lr: default 1e-5. The layout is the process's (made by the Policy): sizes given must
        match it. tokenizer: as Policy.from_pretrained's (the critic reads the policy's token
        ids: a PPOTrainer checks the two tokenizers agree)."""
        who = "Critic.from_pretrained"
        live = sess.current()
        layout = sess.layout_tree(live.layout) if live is not None else {}
        tree = sess.settings(who, {**_model_keys(path_or_hub_id, tokenizer, revision, None),
                                   "critic.dtype": dtype_name(dtype, who), "critic.optim.lr": lr},
                             overrides)
        asked = sess.settings("Policy.from_pretrained", _layout_keys(tensor_parallel_size,
                                                                     pipeline_parallel_size, None))
        # A critic is the gae estimator's: build_critic builds one only for it.
        cfg = sess.config_of(layout, asked, tree, {"algorithm": {"adv_estimator": "gae"}})
        session = sess.session_for(cfg, who)
        info = _read_model(cfg, who, session, tokenizer)
        cfg = micro_batched(cfg, info)
        with build.role_seed(cfg.trainer.seed, "critic"):  # as the Trainer builds it
            critic = build.build_critic(cfg, session.groups, info)
        critic.engine.skip_nonfinite = cfg.trainer.on_nonfinite == "skip"
        return cls(cfg, tree, info, critic)

    def role_for(self, cfg):
        """The critic role of this model and optimizer for an update's `cfg` (its mini-batches
        and epochs), as build.build_critic makes it."""
        cfg = micro_batched(cfg, self.info)
        c, a = cfg.critic, cfg.actor
        return CriticRole(self.critic.engine, c,
                          mini_batch_size=(c.ppo_mini_batch_size or a.ppo_mini_batch_size) * cfg.rollout.n,
                          ppo_epochs=c.ppo_epochs or a.ppo_epochs, agg_mode=a.loss_agg_mode,
                          norm_len=float(cfg.data.max_response_length))


class RewardModel:
    """A learned reward: an HF *ForSequenceClassification model (one label) or its dist
    checkpoint, forward only, at the process's layout; it scores the policy's samples (the
    rollout's token ids when the tokenizers agree, else re-tokenised text: engine/reward_model.py).
    A RolloutWorker adds weight x its score to each sample's reward, as a `reward_model` source
    of reward.sources would."""

    def __init__(self, source: dict, info, scorer):
        self.source, self.info, self.scorer = source, info, scorer

    @property
    def name(self) -> str:
        return self.source["name"]

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, *, policy: Policy, name: str = "reward_model",
                        weight: float = 1.0, dtype: Any = None, tokenizer: Optional[str] = None,
                        revision: Optional[str] = None, micro_batch_size: Optional[int] = None,
                        max_tokens_per_microbatch: Optional[int] = None) -> "RewardModel":
        """policy: the policy whose samples it scores (its tokenizer decides whether they are
        re-tokenised). name: the reward source's name (metrics reward/<name>/mean); the other
        arguments are those of a reward.sources entry of type reward_model."""
        who = "RewardModel.from_pretrained"
        source = {k: v for k, v in dict(
            name=name, type="reward_model", path=os.fspath(path_or_hub_id), weight=weight,
            dtype=dtype_name(dtype, who), tokenizer=tokenizer, revision=revision,
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch).items() if v is not None}
        cfg = sess.config_of(policy._tree, {"reward": {"sources": [source]}})
        session = sess.session_for(cfg, who)
        build.fetch_for_run(cfg)
        key, spec = build.reward_model_sources(cfg)[0]

        def read():
            try:
                return build.reward_model_info(cfg, key, spec)
            except (ValueError, OSError) as e:
                raise ConfigError(f"{who}: {e}") from e

        info = all_ranks_agree(read, f"reading the model of {who}")
        # The source's own micro-batch settings, else the actor's as the Trainer resolves them.
        cfg = micro_batched(cfg, policy.info)
        scorer = build.build_reward_models(cfg, session.groups, policy.info, {name: info})[name]
        return cls(source, info, scorer)
