"""A calculator for the TP_g tests that logs each call: the pid of the trainer rank whose sandbox
ran it (the worker's parent) into the file `log` (a kwarg, not in the schema)."""
import os


def calculator(expression: str, log: str = "") -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression
    """
    with open(log, "a") as f:
        f.write(f"{os.getppid()}\n")
    return "42"
