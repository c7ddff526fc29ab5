"""Exceptions raised in one layer and handled in another (the foundations: no imports).

ConfigError is what every layer raises for a config problem the user must fix. The run-stopping
failures below cross ranks by name (placement: a role set's failure reaches the other sets as
its class name and message), so the class a rank raises again is looked up here, where the
distributed code can see it without importing the trainer, the reward manager or the rollout.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A config problem the user must fix; the message names the key(s) to change."""


class NonFiniteError(RuntimeError):
    """Non-finite numbers in a phase's results or an update: the run stops at its last good
    step."""


class RewardFailureError(RuntimeError):
    """More than reward.max_failed_fraction of a batch failed to score: the run stops."""


class WeightSyncError(RuntimeError):
    """The engine's log-probs disagree with the trainer's beyond the configured bound."""


class RoleSetFailure(RuntimeError):
    """Raised on the ranks of other sets when a role set's phase failed."""


# The failures the trainer treats specially (every rank then stops the same way: NonFiniteError
# commits pending saves), by class name.
_KNOWN = {cls.__name__: cls for cls in (NonFiniteError, RewardFailureError, WeightSyncError)}


def failure_class(kind: str) -> type:
    """The failing set's exception class where the trainer treats it specially, else
    RoleSetFailure."""
    return _KNOWN.get(kind, RoleSetFailure)
