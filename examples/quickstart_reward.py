"""Reward for the quickstart task: "repeat the digit d : " -> "dddd".

Dense on purpose, so a tiny model trained from random weights gets a signal from its first
samples: each of the first four characters of the response earns 1/4 when it is the digit.
"""


def repeat_digit_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str.strip()
    hits = sum(1 for ch in text[:4] if ch == ground_truth)
    return {"score": hits / 4.0, "exact": float(text == ground_truth * 4)}
