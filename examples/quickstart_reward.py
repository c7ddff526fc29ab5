"""Reward for the quickstart task: "repeat the digit d : " -> "dddd".

Dense on purpose, so a tiny model trained from random weights gets a signal from its first
samples: each of the first four characters of the response earns 1/4 when it is the digit.
"""


def repeat_digit_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str.strip()
    hits = sum(1 for ch in text[:4] if ch == ground_truth)
    return {"score": hits / 4.0, "exact": float(text == ground_truth * 4)}


class RepeatDigitJudge:
    """The same reward as a batch class, as verl-style reward classes are written: constructed
    once per scoring process with reward.custom_cls.kwargs (or a source's kwargs), then called
    with a whole batch. `batch["responses"]` and every dataset column are lists of B samples."""

    def __init__(self, length: int = 4):
        self.length = length

    def compute_reward(self, batch):
        scores = []
        for text, rm in zip(batch["responses"], batch["reward_model"]):
            digit = rm["ground_truth"]
            scores.append(sum(ch == digit for ch in text.strip()[:self.length]) / self.length)
        return scores
