"""Reward of the arithmetic recipe (tools/make_arith_data.py; configs/*_smollm2_arith.yaml):
1 for the right answer in the asked-for format, else 0.

The prompt asks for the number only, and the format is parsed strictly: the whole response,
stripped, must be the integer, optionally after the equation that leads to it and optionally with
a final period ("25", "25.", "12 + 13 = 25"). Anything else scores 0 even when the right number
is in it ("The answer is 25.", "25\n\nThis is because ..."), so the model is paid for answering,
not for explaining, and a response cut at the length limit never counts.

`format` (1 when the response has that shape, right or wrong) is logged beside the score
(reward/format/mean in training, val/arith/reward/format/mean in validation): it shows the model
learning the form apart from the sums.

The top level imports the standard library only: the bench (bench/bench_real_model.py) loads this
file into TRL's process too.
"""
import re

# An optional equation (digits, operators, parentheses, spaces) and "=", then the answer.
_ANSWER = re.compile(r"(?:[0-9+\-*/() ]+=\s*)?(-?[0-9]+)\.?")


def parse_answer(response: str):
    """The integer a response answers with, or None when it is not in the strict format."""
    found = _ANSWER.fullmatch(response.strip())
    return int(found.group(1)) if found else None


def arith_score(data_source, solution_str, ground_truth, extra_info=None):
    try:
        truth = int(ground_truth)
    except (TypeError, ValueError):
        raise ValueError(f"arith_score: ground_truth {ground_truth!r} of data_source "
                         f"{data_source!r} is not an integer (reward_model.ground_truth of the "
                         f"row {extra_info!r})") from None
    answer = parse_answer(solution_str)
    return {"score": float(answer == truth), "format": float(answer is not None)}
