"""What the Python API's objects share in one process: torch.distributed, megatron-core's process
groups, and the Config each object builds from its keyword arguments.

Process groups. megatron-core's parallel state is global to a process, so one process holds one
layout (TP, PP, generation TP, ...). The first object made (normally `Policy.from_pretrained`)
initialises torch.distributed when nobody has (from the torchrun / Slurm / MPI environment, as
the trainer does: distributed/launch.py; gloo and the CPU support layer without CUDA), builds the
groups (distributed/groups.build_groups) and seeds the generators as `Trainer` does. Every later
object takes that layout; one asking for another fails, naming both.

Config. Each object owns some keys of the one `Config` tree (the OWNED table): its keyword
arguments are those keys, and its `overrides` ("a.b.c=value", the trainer's syntax) may set any
other key it owns. A key another object owns fails naming that object (a learning rate given to
the PPOTrainer would configure nothing: the optimizer is the Policy's); a key no object reads
fails too, and so does one inside an owned section that no object reads (NOT_READ). The Config
is made by the schema's own loader (config/loading.from_dict: types and key names checked) and
checked by config/validate.validate, as the trainer's is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from verl_mcore.config import Config, ConfigError, validate
from verl_mcore.config.loading import apply_override, from_dict, parse_override
from verl_mcore.distributed.groups import build_groups
from verl_mcore.distributed.launch import detect_launch, init_distributed, setup_logging
from verl_mcore.distributed.watchdog import process_group_timeout
from verl_mcore.engine.engine import training_device
from verl_mcore.utils.rng import seed_everything

# The keys of each object: a key ending in "." stands for its whole section. The longest match
# decides (`actor.optim.lr` is the Policy's though `actor.` keys are the PPOTrainer's).
OWNED: dict[str, tuple[str, ...]] = {
    "Policy.from_pretrained": (
        "model.", "parallel.", "rollout.tensor_parallel_size", "actor.dtype",
        "actor.micro_batch_size_per_gpu", "actor.max_tokens_per_microbatch",
        "actor.recompute_activations", "actor.optim.", "reference.", "trainer.seed",
        "trainer.device", "trainer.on_nonfinite", "trainer.max_consecutive_skips",
        "trainer.collective_timeout_s", "trainer.total_steps"),
    "RolloutWorker": (
        "rollout.engine", "rollout.n", "rollout.temperature", "rollout.top_p", "rollout.top_k",
        "rollout.seed", "rollout.gpu_memory_utilization", "rollout.max_num_seqs",
        "rollout.keep_weights_buffer", "rollout.logprob_check.", "data.prompt_key",
        "data.max_prompt_length", "data.max_response_length", "data.truncation",
        "data.on_bad_row", "data.apply_chat_template", "reward."),
    "PPOTrainer": (
        "algorithm.", "actor.ppo_mini_batch_size", "actor.ppo_epochs", "actor.policy_loss",
        "actor.clip_ratio_low", "actor.clip_ratio_high", "actor.clip_ratio_c",
        "actor.loss_agg_mode", "actor.entropy_coeff", "actor.use_kl_loss", "actor.kl_loss_coef",
        "actor.kl_loss_type", "actor.recompute_old_log_probs", "actor.mask_truncated_samples",
        "critic.ppo_mini_batch_size",
        "critic.ppo_epochs", "critic.cliprange_value", "critic.warmup_steps",
        "critic.recompute_values"),
    "Critic.from_pretrained": (
        "model.", "critic.dtype", "critic.micro_batch_size_per_gpu",
        "critic.max_tokens_per_microbatch", "critic.recompute_activations", "critic.optim.",
        "trainer.total_steps"),
}

# Keys inside a section an object owns that no API object reads, and what to do instead.
NOT_READ: dict[str, str] = {
    "algorithm.filter_groups.": "dynamic sampling refills the trainer's batches; in your own "
                                "loop keep the groups you want with Experiences.select_groups and "
                                "generate more",
}


def _owns(prefixes: Sequence[str], key: str) -> int:
    """Length of the longest prefix of `prefixes` that covers `key` (0: none)."""
    return max((len(p) for p in prefixes if key == p or (p.endswith(".") and key.startswith(p))),
               default=0)


def settings(who: str, keys: dict[str, Any], overrides: Sequence[str] = ()) -> dict:
    """The config tree of `who`'s settings: `keys` ("a.b.c" -> value; None: the config's
    default), then `overrides` ("a.b.c=value"). Every key must be one `who` owns (OWNED)."""
    tree: dict = {}
    given = [(k.split("."), v, f"{k}={v!r}") for k, v in keys.items() if v is not None]
    given += [(*parse_override(text), text) for text in overrides]
    for path, value, text in given:
        key = ".".join(path)
        unread = next((why for prefix, why in NOT_READ.items() if _owns((prefix,), key)), None)
        if unread is not None:
            raise ConfigError(f"{who}: {text}: the Python API does not read {key} ({unread})")
        mine = _owns(OWNED.get(who, ()), key)
        owner = max(OWNED, key=lambda o: _owns(OWNED[o], key))
        if mine == 0 or mine < _owns(OWNED[owner], key):
            if _owns(OWNED[owner], key) == 0:
                raise ConfigError(f"{who}: {text}: the Python API does not read {key} (data files, "
                                  "validation, checkpoints and logging are verl_mcore.train's; "
                                  "your own loop does those)")
            raise ConfigError(f"{who}: {text} is a setting of {owner}, which builds what it "
                              f"configures: give it there")
        apply_override(tree, path, value)
    return tree


def merged(*trees: dict) -> dict:
    """One tree from several (a key of a later tree wins)."""
    out: dict = {}
    for tree in trees:
        for k, v in tree.items():
            out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def config_of(*trees: dict) -> Config:
    """The Config of `trees` merged, every key and type checked by the schema's loader."""
    return from_dict(Config, merged(*trees))


def check(cfg: Config, who: str, world: int, shape=None, *, lengths: bool = False,
          batches: bool = False, what: str = "") -> None:
    """config/validate.validate without data files (prompts come with each call), with the
    data.* lengths once a RolloutWorker set them and the batch rules once an update has its
    batch; `what`, when given, says how the API's arguments map to the keys the messages name."""
    try:
        validate(cfg, world, shape, data_files=False, lengths=lengths, batches=batches)
    except ConfigError as e:
        raise ConfigError(f"{who}: {e}" + (f"\n  ({what})" if what else "")) from None


# ---------------------------------------------------------------------------------------------
# The process's layout

_LAYOUT_KEYS = {  # config key -> the keyword argument that sets it
    "parallel.tensor_model_parallel_size": "tensor_parallel_size",
    "parallel.pipeline_model_parallel_size": "pipeline_parallel_size",
    "rollout.tensor_parallel_size": "rollout_tensor_parallel_size",
    "parallel.virtual_pipeline_model_parallel_size": None,
    "parallel.context_parallel_size": None,
    "parallel.expert_model_parallel_size": None,
    "parallel.sequence_parallel": None,
    "parallel.use_distributed_optimizer": None,
}


def layout_of(cfg: Config) -> dict[str, Any]:
    return {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in _LAYOUT_KEYS}


def layout_tree(layout: dict[str, Any]) -> dict:
    """The config tree that sets `layout` (for the objects after the first)."""
    tree: dict = {}
    for key, value in layout.items():
        section, name = key.split(".")
        tree.setdefault(section, {})[name] = value
    return tree


@dataclass
class Session:
    """The process's torch.distributed and megatron-core layout, shared by every API object."""

    layout: dict[str, Any]  # layout_of(the first object's config)
    made_by: str
    groups: Any  # distributed/groups.ParallelGroups
    rank: int
    world: int
    device: Any  # the training device (engine.training_device)
    local_rank: int

    def check(self, cfg: Config, who: str) -> None:
        wrong = [k for k, v in layout_of(cfg).items() if self.layout[k] != v]
        if wrong:
            said = ", ".join(f"{_LAYOUT_KEYS[k] or k}={layout_of(cfg)[k]}" for k in wrong)
            have = ", ".join(f"{_LAYOUT_KEYS[k] or k}={self.layout[k]}" for k in wrong)
            raise ConfigError(
                f"{who}: {said}, but this process's parallel layout was set by {self.made_by} "
                f"to {have}: megatron-core's process groups are global to a process, so every "
                "object of one process shares one layout. Give the same sizes (or leave them "
                "unset to take the process's)")


_current: Optional[Session] = None


def current() -> Optional[Session]:
    """The live session, if any (None after megatron's groups were destroyed)."""
    global _current
    if _current is not None:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            _current = None  # torn down (destroy_model_parallel): a new layout may be built
    return _current


def session_for(cfg: Config, who: str) -> Session:
    """The process's session, made from `cfg` if there is none yet (see the module docstring);
    raises ConfigError when `cfg` asks for another layout."""
    global _current
    import torch.distributed as dist
    from megatron.core import parallel_state

    live = current()
    if live is not None:
        live.check(cfg, who)
        return live
    if parallel_state.model_parallel_is_initialized():
        raise ConfigError(f"{who}: megatron-core's process groups are already initialised in "
                          "this process (by a Trainer, or by build_groups in your code); the "
                          "Python API builds its own: use it in a process of its own, or call "
                          "megatron.core.parallel_state.destroy_model_parallel() first")
    launch = detect_launch()
    timeout = process_group_timeout(cfg.trainer.collective_timeout_s).total_seconds()
    if not dist.is_initialized():
        setup_logging(launch.rank)
    # Also when the caller initialised torch.distributed: the device follows trainer.device.
    init_distributed(launch, cfg.trainer.device, timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    check(cfg, who, world)  # the layout fits this world, before megatron asserts it does not
    groups = build_groups(cfg, int(timeout // 60) + 1)
    seed_everything(cfg.trainer.seed, rank)  # as the trainer, before any model is built
    _current = Session(layout_of(cfg), who, groups, rank, world, training_device(),
                       launch.local_rank)
    return _current

