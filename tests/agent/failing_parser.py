"""A tool-call parser for the end-to-end tests that calls the calculator on its first turns, then
raises (a user's parser runs in the trainer: what it raises stops the run) once the sandbox's
workers are running."""
from verl_mcore.agent.tools import ToolCall

_seen = [0]


def fail_later(text, after=2):
    _seen[0] += 1
    if _seen[0] > after:
        raise RuntimeError("the parser gives up")
    return [ToolCall("calculator", {"expression": "6*7"}, text)]
