"""A calculator tool for arithmetic word problems (agent.tools).

    agent:
      tools:
        - {path: examples/agent/calculator.py, name: calculator}

Its schema is derived from the signature and the docstring (verl_mcore/agent/tools.py). The
expression is parsed, never eval'd: numbers, + - * / // % **, unary signs and parentheses only;
a power whose result would be huge is refused rather than computed (2 ** 10 ** 10 would hang the
worker until its timeout).

Standard library only: the sandbox workers import this file.
"""
from __future__ import annotations

import ast
import math
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT_BITS = 4096  # a power's result up to about 1e1233


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 3 / 7"
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return f"Error: {expression!r} is not an arithmetic expression"
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        return "Error: division by zero"
    except (ValueError, OverflowError) as e:
        return f"Error: {e}"
    return _format(value)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 1 and abs(left) > 1 and \
                abs(right) * math.log2(abs(left)) > _MAX_EXPONENT_BITS:
            raise ValueError("the power is too large to compute")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"{ast.unparse(node)!r} is not allowed: use numbers, operators and parentheses")


def _format(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)
