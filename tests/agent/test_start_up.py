"""rollout.agent_loop's start-up checks on the config alone (config/validate.py): each wrong
setting fails naming the key to change, before any file is imported or model built."""
from __future__ import annotations

import pytest

from verl_mcore.config import Config, validate
from verl_mcore.errors import ConfigError

CALC = "[{path: examples/agent/calculator.py, name: calculator}]"


@pytest.mark.parametrize("overrides, message", [
    (["rollout.agent_loop.name=tool"],
     "rollout.agent_loop.name=tool without a path is none of the built-in loops"),
    (["rollout.agent_loop.name=toolz", f"rollout.agent_loop.tools={CALC}"],
     "rollout.agent_loop.name=toolz without a path is none of the built-in loops"),
    (["rollout.agent_loop.name=environment"],
     "rollout.agent_loop.name=environment (built in) runs the configured environment"),
    (["rollout.agent_loop.name=tools"],
     "rollout.agent_loop.name=tools (built in) runs the configured tools"),
    ([f"rollout.agent_loop.tools={CALC}"],
     "rollout.agent_loop.tools / .environment are set but no agent loop runs them"),
], ids=["unknown-name", "unknown-name-with-tools", "environment-without-one", "tools-without-any",
        "tools-without-a-loop"])
def test_agent_loop_settings_fail_naming_the_key(overrides, message):
    cfg = Config.load("configs/quickstart.yaml", overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    assert message in str(e.value), str(e.value)


def test_tools_beside_a_users_loop_are_allowed():
    """A user's loop reaches the tools through ctx.tools; the prompts show them."""
    cfg = Config.load("configs/quickstart.yaml", [
        "rollout.agent_loop.path=tests/agent/toy_loop.py", "rollout.agent_loop.name=ToyLoop",
        f"rollout.agent_loop.tools={CALC}"])
    validate(cfg, 1)


def test_an_environment_reward_with_the_builtin_tools_loop_is_refused():
    """The built-in tools loop returns no reward: every sample would fail its score."""
    cfg = Config.load("examples/agent/calculator.yaml", [
        "model.path=/nonexistent", "reward.sources=[{name: env, type: environment}]"])
    with pytest.raises(ConfigError, match=r"reward.sources\[0\] \('env'\) is an environment "
                                          r"reward.*built-in `tools` loop gives none"):
        validate(cfg, 1)
