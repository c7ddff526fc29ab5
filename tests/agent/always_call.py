"""A tool-call parser for the end-to-end tests: every model turn of the quickstart's tiny model
(random text) "calls" the calculator with a fixed expression, so the built-in tools loop runs
its sandbox, observation and metrics paths on every turn."""
from verl_mcore.agent.tools import ToolCall


def always(text, expression="6*7", tool="calculator"):
    return [ToolCall(tool, {"expression": expression}, text)]
