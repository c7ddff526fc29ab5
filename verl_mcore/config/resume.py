"""A resume whose config differs from the checkpoint's: what is applied, what is refused.

Each actor checkpoint records the resolved config it was saved with (`config.yaml`, usable as
`--config`) and the model's architecture (`model_arch.json`). On resume every key whose value
differs is logged, one line per key,

    actor.optim.lr: 0.003 in the checkpoint -> 0.0001 from the config

and the config's value is used, including where the checkpoint restores state:
  - the LR schedule, actor and critic (lr, min_lr, lr_schedule, lr_warmup_steps, weight_decay;
    its length follows trainer.total_steps and the batch sizes): the scheduler is built with
    megatron's override_opt_param_scheduler, so a load restores only its step counter
    (engine/engine.py _build_scheduler), rescaled to this config's optimizer steps per
    training step when the batch sizes or ppo_epochs changed (rescale_schedule);
  - the optimizer's settings (lr bounds, betas, eps), which megatron's optimizer load replaces
    with the saved param groups': put back after the load
    (MegatronEngine.config_hyperparameters_kept);
  - clip_grad and every loss / batch / sampling setting: read from the config at each step;
  - the KL controller: a changed algorithm.kl_ctrl.type or kl_coef starts it afresh at the
    config's coefficient (unchanged, an adaptive controller keeps the coefficient it reached);
  - data.train_batch_size: the prompt loader keeps its place in the epoch (PromptLoader.rebatch);
    refused when the checkpoint holds batches sampled ahead (one_step_off) or partial rollouts
    in flight, whose prompts are drawn again at the saved batch size (apply_to_state, after the
    weights are loaded); rollout.partial.enable turned off drops the samples in flight (logged).
Refused before any weight is read (ResumeConfigError, naming the key and what to do):
  - another model architecture (model_arch.json against model.path's config.json);
  - another padded vocabulary size (model.make_vocab_size_divisible_by with the training TP):
    the embedding and output layer have that many rows;
  - algorithm.adv_estimator=gae from a checkpoint of a run without a critic;
  - data.seed, data.shuffle: the prompts still to come this epoch would change (data.seed as the
    run draws it: null derives it from trainer.seed, config/seeds.py, so another trainer.seed
    is refused there too);
  - a LoRA role's lora.r, lora.alpha, lora.target_modules (actor and critic): the adapters'
    shapes or their scale;
  - parallel.use_distributed_optimizer, when the checkpoint holds optimizer state: the two
    optimizers' states have different formats (megatron-core 0.16.1 fails with KeyError
    'pre_wd_mult' loading one into the other).
TP / PP / DP sizes and the roles' dtypes may change: the trainer's checkpoints hold global
tensors, the optimizer state included (fully_reshardable), and reshard at load
(engine/checkpoint.py; tests/engine/test_checkpoint_layouts.py: TP2 -> TP1 x DP2 and -> PP2;
actor.dtype fp32 -> bf16 seen to load; VPP changes are not tested), the vocabulary padding aside.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Callable, Optional

import yaml

from verl_mcore.config.loading import ConfigError, to_dict
from verl_mcore.config.seeds import resolve_saved_seeds, resolve_seeds
from verl_mcore.utils.manifest import weights_fingerprint

log = logging.getLogger("verl_mcore.config.resume")

CONFIG_FILE = "config.yaml"
ARCH_FILE = "model_arch.json"
ORDER_KEYS = ("data.seed", "data.shuffle")  # PromptLoader's order of the prompts
KL_KEYS = ("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef")
# What a role's adapters are: their tensors' shapes and set (r, target_modules) and the function
# they compute (alpha / r scales B·A). lora.enable itself is matched at load (engine/checkpoint.py).
LORA_KEYS = ("r", "alpha", "target_modules")


class ResumeConfigError(ConfigError):
    """A config value that cannot change when resuming from this checkpoint."""


@dataclasses.dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    current: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.saved!r} in the checkpoint -> {self.current!r} from the config"


def checkpoint_files(cfg, arch) -> dict[str, str]:
    """{name: text} to save in every actor checkpoint of this run."""
    return {CONFIG_FILE: cfg.to_yaml(),
            ARCH_FILE: json.dumps(_arch_record(cfg, arch), indent=1, sort_keys=True) + "\n"}


def _arch_record(cfg, arch) -> dict:
    record = dataclasses.asdict(arch)
    record.pop("torch_dtype", None)  # the HF file's storage dtype; the roles' dtypes are config
    record["padded_vocab_size"] = arch.padded_vocab_size(
        cfg.parallel.tensor_model_parallel_size, cfg.model.make_vocab_size_divisible_by)
    return record


def compare(checkpoint: str, cfg, arch) -> list[Change]:
    """The keys whose value in `cfg` differs from the one `checkpoint` was saved with; raises
    ResumeConfigError naming every key that cannot change. A checkpoint without the record
    (written before it existed) is resumed as before, with a warning."""
    try:
        with open(os.path.join(checkpoint, CONFIG_FILE)) as f:
            saved = yaml.safe_load(f)
        with open(os.path.join(checkpoint, ARCH_FILE)) as f:
            saved_arch = json.load(f)
    except (OSError, ValueError, yaml.YAMLError) as e:
        log.warning("checkpoint %s has no readable record of its config (%s): the config's "
                    "changes since are neither listed nor checked", checkpoint, e)
        return []
    # The seeds the two configs draw from, null ones derived from their trainer.seed: another
    # trainer.seed under a derived data.seed reorders the prompts as surely as another data.seed.
    saved, cfg = resolve_saved_seeds(saved), resolve_seeds(cfg)
    # Keys the checkpoint's config lacks (added to the schema since) are left out.
    changes = [Change(k, _lookup(saved, k), v) for k, v in _leaves(cfg)
               if _lookup(saved, k) not in (_MISSING, v)]
    refused = _refused(changes, saved, saved_arch, _arch_record(cfg, arch), cfg)
    if refused:
        raise ResumeConfigError(
            f"cannot resume from {checkpoint} with this config:\n  - " + "\n  - ".join(refused)
            + f"\n(The checkpoint's config is {os.path.join(checkpoint, CONFIG_FILE)}.)")
    return changes


def check_lora_base(checkpoint: str, base_weights: Optional[str]) -> None:
    """ResumeConfigError when `checkpoint` holds LoRA adapters trained on other base weights
    than `base_weights` (the run's model.checkpoint or model.path directory) hold now: pointed
    at another model of the same architecture, the saved adapters would train on it silently
    (its config passes every other check). Compares meta.json's base_fingerprint with
    utils/manifest.weights_fingerprint, reading ~0.5 MB a weight file."""
    try:
        with open(os.path.join(checkpoint, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return  # verify_checkpoint reports an unreadable meta.json
    saved = meta.get("base_fingerprint") if meta.get("trainable_only") else None
    if saved and base_weights and os.path.isdir(base_weights) \
            and weights_fingerprint(base_weights) != saved:
        raise ResumeConfigError(
            f"cannot resume from {checkpoint} with this config: its LoRA adapters were trained on "
            f"the base {meta.get('base_weights')}, and {base_weights} (model.path, or "
            f"model.checkpoint) holds other weights (utils/manifest.weights_fingerprint "
            f"differs): the adapters would train on another model. Point model.path at the base "
            f"the run started from, or start the adapters fresh in a new trainer.run_dir")


def _refused(changes: list[Change], saved: dict, saved_arch: dict, arch: dict, cfg) -> list[str]:
    out = []
    vocab_saved, vocab_now = saved_arch.get("padded_vocab_size"), arch["padded_vocab_size"]
    shapes = {k: (saved_arch.get(k), v) for k, v in arch.items()
              if k != "padded_vocab_size" and k in saved_arch and saved_arch[k] != v}
    if shapes:
        detail = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(shapes.items()))
        out.append(f"model.path={cfg.model.path}: another architecture than the checkpoint's "
                   f"({detail}); its weights cannot load into this model. Point model.path at "
                   f"the model the run started from (the checkpoint's model.path was "
                   f"{_lookup(saved, 'model.path')}), or start a new run in a new trainer.run_dir")
    elif vocab_saved != vocab_now:
        out.append(f"the vocabulary is padded to {vocab_now} rows (model.make_vocab_size_divisible_by"
                   f"={cfg.model.make_vocab_size_divisible_by} at "
                   f"parallel.tensor_model_parallel_size={cfg.parallel.tensor_model_parallel_size}), "
                   f"the checkpoint's embedding has {vocab_saved} (make_vocab_size_divisible_by="
                   f"{_lookup(saved, 'model.make_vocab_size_divisible_by')} at TP="
                   f"{_lookup(saved, 'parallel.tensor_model_parallel_size')}); set "
                   f"model.make_vocab_size_divisible_by so that the padding is {vocab_saved} "
                   f"again (the padded size is a multiple of lcm(it, TP))")
    by_key = {c.key: c for c in changes}
    estimator = by_key.get("algorithm.adv_estimator")
    if estimator is not None and estimator.current == "gae" and estimator.saved != "gae":
        out.append(f"{estimator}: the checkpoint has no critic to resume; keep "
                   f"algorithm.adv_estimator={estimator.saved}, or start a new run in a new "
                   f"trainer.run_dir")
    optimizer = by_key.get("parallel.use_distributed_optimizer")
    if optimizer is not None and _lookup(saved, "checkpoint.save_optimizer") is not False:
        out.append(f"{optimizer}: the checkpoint's optimizer state has the other optimizer's "
                   f"format; set parallel.use_distributed_optimizer={optimizer.saved} again")
    for role in ("actor", "critic"):
        if _lookup(saved, f"{role}.lora.enable") is True and getattr(cfg, role).lora.enable:
            for key in (f"{role}.lora.{k}" for k in LORA_KEYS):
                if key in by_key:
                    out.append(f"{by_key[key]}: the checkpoint's {role} LoRA adapters were "
                               f"trained with {key}={by_key[key].saved!r} and cannot load into "
                               f"(or would compute something else in) adapters of another one; "
                               f"set it again, or start a new run in a new trainer.run_dir")
    for key in ORDER_KEYS:
        if key in by_key:
            out.append(f"{by_key[key]}: the prompts still to come would change mid-epoch; set "
                       f"{key}={by_key[key].saved!r} again, or start a new run")
    return out


def apply_to_state(changes: list[Change], state: dict,
                   rebatch_loader: Callable[[dict, int], dict]) -> dict:
    """The checkpoint's trainer state with the config's changes applied where it holds the
    old value (see the module docstring); logs every change. `rebatch_loader(state, batch_size)`:
    the prompt loader's saved position at another batch size (data/loader.PromptLoader.rebatch,
    passed in: the data package reads the config, not the other way round)."""
    for change in changes:
        log.info("resume: %s", change)
    keys = {c.key: c for c in changes}
    state = dict(state)
    if any(k in keys for k in KL_KEYS):
        state["kl_ctrl"] = None  # the controller starts afresh from the config
    if "data.train_batch_size" in keys and state.get("rollout_partial") is not None:
        # The groups in flight are found again by their place in the saved batches.
        change = keys["data.train_batch_size"]
        raise ResumeConfigError(
            f"cannot resume with this config: {change}: the checkpoint holds partial rollouts "
            f"in flight (rollout.partial), whose prompts are found again by drawing batches of "
            f"{change.saved} prompts. Set data.train_batch_size={change.saved} again for this "
            f"resume")
    saved_pool = state.get("rollout_partial") or {}
    if "rollout.mode" in keys and saved_pool.get("mode") == "fully_async":
        # The pools and the batch handed over are fully_async's (fully_async.py): another
        # producer would drop the batch, whose prompts the loader does not hand out again.
        change = keys["rollout.mode"]
        raise ResumeConfigError(
            f"cannot resume with this config: {change}: the checkpoint holds rollout.mode="
            f"fully_async's samples in flight and the batch it handed over for the next step. "
            f"Set rollout.mode={change.saved} again for this resume")
    if "rollout.partial.enable" in keys and state.get("rollout_partial") is not None:
        log.warning("resume: rollout.partial.enable changed: the checkpoint's samples in flight "
                    "are dropped, and the prompt loader goes back to the oldest batch they came "
                    "from (some of its prompts train again)")
    if "data.train_batch_size" in keys:
        queued = state.get("rollout_queue") or []
        if queued:
            # The resume draws the queued batches' prompts again for their dataset rows (ground
            # truth, data source): at another batch size they would be other rows.
            change = keys["data.train_batch_size"]
            raise ResumeConfigError(
                f"cannot resume with this config: {change}: the checkpoint holds {len(queued)} "
                f"batch(es) of {change.saved} prompts sampled ahead (rollout.mode=one_step_off), "
                f"whose dataset rows are found again by drawing them at that batch size. Set "
                f"data.train_batch_size={change.saved} again for this resume (it can change "
                f"at a resume from a checkpoint that holds no batch sampled ahead)")
        state["loader"] = rebatch_loader(state["loader"], keys["data.train_batch_size"].current)
    return state


def rescale_schedule(role: str, scheduler, saved_per_step: int, per_step: int) -> None:
    """Put `scheduler` (just loaded: its step counter in the checkpoint's optimizer steps) at
    the same training step in this config's optimizer steps. Its length is total_steps times
    per_step (build.optimizer_steps_per_training_step), so a changed ppo_mini_batch_size,
    ppo_epochs or train_batch_size kept the old counter against a new length: the LR jumped.
    Skipped updates and critic warmup scale with it (they are whole training steps)."""
    if per_step == saved_per_step:
        return
    steps = scheduler.num_steps * per_step // saved_per_step
    log.info("resume: %s LR schedule at optimizer step %d of the checkpoint (%d per training "
             "step) -> %d (%d per training step)", role, scheduler.num_steps, saved_per_step,
             steps, per_step)
    scheduler.num_steps = 0
    scheduler.step(steps)  # sets the param groups' lr and weight decay for that step


_MISSING = object()


def _leaves(obj, prefix: str = ""):
    """(dotted key, plain value) of every field of a config dataclass tree; dict- and
    list-valued fields (reward.routes, reward.sources) are one value each."""
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", to_dict(value)


def _lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree
