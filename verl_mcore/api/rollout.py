"""RolloutWorker: the policy's rollout engine and the rewards, `generate(prompts) -> Experiences`.

    worker = RolloutWorker(policy, max_new_tokens=256, temperature=1.0, n=8, reward_fn=score)
    experiences = worker.generate(["What is 2 + 3?", ...])      # or chat messages, or rows

What one call does is the first half of `Trainer.step`, by the trainer's own sampler and
scorer (sampler.py, scoring.py): bring the policy's weights into the generation layout and check them, sample n
responses per prompt (each generation replica its share of the prompts), gather every replica's
samples on every rank, score them. Every rank calls it with the same prompts (SPMD).

Prompts. A string (one user message), a list of chat messages ({"role", "content"}), or a
dataset row: a dict with the prompt under data.prompt_key ("prompt") and whatever the rewards
read (data_source, reward_model.ground_truth, extra_info, any column). They go through the
dataset's checks, chat template, tokenisation and length policy (data/dataset.py) as a data
file's rows do.

Rewards. `reward_fn(data_source, response, ground_truth, extra_info) -> float | {"score": ...}`
(a Python callable, called in this process), or the name of a built-in scorer (reward/builtin.py:
every sample scored by it), or None: the built-in scorer of each row's data_source. RewardModel
objects add their weighted scores (reward_fn then weighs 1). reward.* overrides configure the
rest as in a config file (custom sources, routing, failures: reward/manager.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from verl_mcore import build
from verl_mcore.api import session as sess
from verl_mcore.api.buffer import Experiences
from verl_mcore.config import ConfigError, ModelShape
from verl_mcore.data import PromptLoader
from verl_mcore.data.dataset import RLHFDataset
from verl_mcore.distributed.agree import all_ranks_agree
from verl_mcore.distributed.placement import RolePlacement
from verl_mcore.reward import RewardManager
from verl_mcore.sampler import Sampler
from verl_mcore.scoring import Scorer
from verl_mcore.stage_timer import StageTimer

PROMPTS_LABEL = "the prompts given to RolloutWorker.generate"


class RolloutWorker:
    """The policy's generation engine (rollout.engine: native or vllm) with a reward.

    max_new_tokens: the longest response (data.max_response_length). n: responses per prompt.
    temperature, top_p, top_k, seed: sampling (temperature 0: greedy). max_prompt_length:
    the longest prompt in tokens after the chat template (default: what the model's positions
    leave). greedy_baseline: also generate one greedy response per prompt and score it (ReMax's
    baseline). overrides: more keys of the worker's (rollout.*, data.truncation, reward.*:
    session.OWNED lists them).
    """

    def __init__(self, policy, *, max_new_tokens: int, n: int = 1,
                 temperature: Optional[float] = None, top_p: Optional[float] = None,
                 top_k: Optional[int] = None, seed: Optional[int] = None,
                 max_prompt_length: Optional[int] = None,
                 reward_fn: Union[None, str, Callable] = None, reward_models: Sequence[Any] = (),
                 greedy_baseline: bool = False, overrides: Sequence[str] = ()):
        who = "RolloutWorker"
        self.policy = policy
        session = policy._session
        positions = policy.info.arch.max_position_embeddings
        keys = {"data.max_response_length": max_new_tokens, "rollout.n": n,
                "rollout.temperature": temperature, "rollout.top_p": top_p, "rollout.top_k": top_k,
                "rollout.seed": seed,
                "data.max_prompt_length": max_prompt_length or max(1, positions - max_new_tokens)}
        keys.update(_reward_keys(reward_fn, reward_models))
        self._tree = sess.settings(who, keys, overrides)
        self.cfg = sess.config_of(policy._tree, self._tree)
        sess.check(self.cfg, who, session.world, _shape(policy), lengths=True,
                   what="data.max_response_length is max_new_tokens, rollout.* the sampling "
                        "arguments; the model's positions bound prompt + response")
        _check_reward_models(self.cfg, policy, reward_models)
        self.greedy_baseline = greedy_baseline
        score_fn = reward_fn if callable(reward_fn) else None
        self.rewards = all_ranks_agree(
            lambda: RewardManager.from_config(
                self.cfg.reward, score_fn=score_fn,
                scored_outside=[s.name for s in self.cfg.reward.sources if s.type == "reward_model"]),
            "starting the rewards of the RolloutWorker", cleanup=lambda m: m.close())
        phase = build.build_generation_phase(self.cfg, session.groups, policy.info,
                                             policy.actor_for(self.cfg))
        place = RolePlacement.everywhere(session.groups, ("actor", "reward_model"))
        self._sampler = Sampler(self.cfg, policy.info, place, phase)
        self._scorer = Scorer(self.cfg, self.rewards, {rm.name: rm.scorer for rm in reward_models},
                              [rm.name for rm in reward_models], place, policy.info.tokenizer,
                              session.device, session.rank)
        self._calls = 0  # generate calls so far: each samples with the next batch's seeds

    def generate(self, prompts: Sequence[Any]) -> Experiences:
        """n responses for each prompt, scored (module docstring); the same Experiences on
        every rank."""
        sampler, cfg = self._sampler, self.cfg
        batch = self._prompt_batch(prompts)  # this generation replica's share
        timer, step = StageTimer(), self._calls + 1
        try:
            with timer("sync"):
                sync_metrics = sampler.begin(step, batch.input_ids)  # weights + sync check
            with timer("gen"):
                rollout = sampler.generate(batch, sampler.sampling(cfg.rollout.n,
                                                                   cfg.rollout.temperature,
                                                                   self._calls))
                baseline = None
                if self.greedy_baseline:
                    baseline = sampler.generate(batch, sampler.sampling(1, 0.0, self._calls,
                                                                        seed_offset=1))
        finally:
            sampler.end()  # the KV cache (and weight buffer) go back before training
        engine_metrics = sampler.stats()  # preemptions, peak live sequences, occupancy
        rollout = rollout.to(self._scorer.device)
        with timer("reward"):
            scores, reward_metrics, extras = self._scorer.train_scores(rollout)
            if baseline is not None:
                baseline = self._scorer.train_scores(baseline)[0].repeat_interleave(cfg.rollout.n)
        self._calls += 1  # the next call samples with the next seeds, as the trainer's next step
        rollout = dataclasses.replace(rollout, version=self.policy.version)
        return Experiences(rollout.scored(scores, extras, baseline),
                           {**sync_metrics, **engine_metrics, **reward_metrics, **timer.metrics()},
                           cfg, self.policy)

    def _prompt_batch(self, prompts: Sequence[Any]):
        """This generation replica's PromptBatch of `prompts`, through the dataset's checks,
        template and tokenisation; every replica's slice as the trainer's loader cuts it."""
        groups = self.policy._session.groups
        if isinstance(prompts, (str, Mapping)) or not len(prompts):
            raise TypeError("RolloutWorker.generate takes a non-empty list of prompts")
        key = self.cfg.data.prompt_key
        rows = [_row(p, key, i) for i, p in enumerate(prompts)]
        data = RLHFDataset(PROMPTS_LABEL, self.policy.info.tokenizer, self.cfg.data, rows=rows)
        try:  # a data_source no built-in scorer knows fails here, not as 0 rewards
            self.rewards.check_dataset(data)
        except ValueError as e:
            raise ValueError(f"RolloutWorker.generate: {e} (or give the RolloutWorker a "
                             "reward_fn)") from None
        replicas = groups.layout.dp_gen
        if len(data) % replicas:
            raise ValueError(f"RolloutWorker.generate: {len(data)} prompts do not split over the "
                             f"{replicas} generation replicas (world size / rollout tensor "
                             f"parallel size); give a multiple of {replicas}")
        return next(PromptLoader(data, len(data), rank=groups.gen_dp_rank, world_size=replicas,
                                 shuffle=False))

    def close(self) -> None:
        """Stop the reward's scoring processes (reward.num_workers > 0)."""
        self.rewards.close()

    def __enter__(self) -> "RolloutWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _row(prompt: Any, key: str, i: int) -> dict:
    """A dataset row of one prompt. A string becomes one user message, which the dataset renders
    as it renders the string itself (with or without a chat template), so that strings and
    message lists mix in one call (one Arrow column)."""
    if isinstance(prompt, Mapping):
        row = dict(prompt)
        if isinstance(row.get(key), str):
            row[key] = [{"role": "user", "content": row[key]}]
        return row
    if isinstance(prompt, str):
        return {key: [{"role": "user", "content": prompt}]}
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        return {key: list(prompt)}
    raise TypeError(f"RolloutWorker.generate: prompt {i} is a {type(prompt).__name__}; give a "
                    "string, a list of chat messages ({'role': ..., 'content': ...}) or a dataset "
                    f"row (a dict with the prompt under {key!r})")


def _reward_keys(reward_fn, reward_models) -> dict[str, Any]:
    """reward.* keys for reward_fn (module docstring) and the reward models' sources."""
    keys: dict[str, Any] = {}
    if callable(reward_fn):
        keys["reward.num_workers"] = 0  # a Python callable scores in this process
    elif isinstance(reward_fn, str):  # every sample by this built-in scorer, whatever its source
        keys.update({"reward.route_by": "data_source", "reward.default_route": reward_fn})
    elif reward_fn is not None:
        raise TypeError(f"RolloutWorker: reward_fn is a {type(reward_fn).__name__}; give a "
                        "function (data_source, response, ground_truth, extra_info) -> float, a "
                        "built-in scorer's name, or None")
    if reward_models:
        rule = [{"name": "rule", "type": "rule", "weight": 1.0}] if reward_fn is not None else []
        keys["reward.sources"] = rule + [dict(rm.source) for rm in reward_models]
    return keys


def _check_reward_models(cfg, policy, reward_models) -> None:
    """Every reward_model source is one of `reward_models`, each fed what it can read (the
    checks build.build_inputs makes of a config's reward models, with the worker's lengths)."""
    given = {rm.name for rm in reward_models}
    for i, source in enumerate(cfg.reward.sources):
        if source.type == "reward_model" and source.name not in given:
            raise ConfigError(f"RolloutWorker: reward.sources[{i}] ({source.name!r}) is a reward "
                              "model: give it as reward_models=[RewardModel.from_pretrained(...)]")
    for i, rm in enumerate(reward_models):
        if rm.scorer.retokenize and rm.scorer.prompt_key != cfg.data.prompt_key:
            raise ConfigError(f"RolloutWorker: reward model {rm.name!r} re-tokenises the prompts "
                              f"of column {rm.scorer.prompt_key!r}, but data.prompt_key is "
                              f"{cfg.data.prompt_key!r}; give them the same key")
        build.check_reward_model_tokens(cfg, policy.info, f"reward_models[{i}]", rm.info)


def _shape(policy):
    return ModelShape.from_hf_dir(policy.info.hf_dir) if policy.info.hf_dir else None
