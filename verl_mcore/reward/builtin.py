"""The built-in rule scorers, dispatched by the sample's `data_source`.

The table holds the data_source names that verl's `default_compute_score` sends to the scorers we
have, and only those, so a dataset prepared for verl gets the same scorer here:
  GSM8K (`#### 72`, 1/0)    openai/gsm8k
  MATH (`\\boxed`, 1/0)     lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500
  DAPO (`Answer:`, +1/-1)  math_dapo, math, math_dapo_reasoning, and every name starting with aime
Any other name (`gsm8k`, `lighteval/MATH-Hard`, `EleutherAI/hendrycks_math`, ...) has no built-in
scorer, as in verl: route it to one with reward.routes, or set reward.custom_fn.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

from verl_mcore.reward import gsm8k, math_answers, math_dapo

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning", "aime*")


class ScorerTable(dict):
    """data_source -> scorer, where a key ending in `*` stands for every name with that prefix
    (verl scores `aime24`, `aime_2025`, ... with one scorer). `in`, `[]` and `get` see the
    prefixes, so the reward manager's start-up check and routes need no special case."""

    def __missing__(self, name):
        if isinstance(name, str):
            for key, scorer in self.items():
                if key.endswith("*") and name.startswith(key[:-1]):
                    return scorer
        raise KeyError(name)

    def __contains__(self, name) -> bool:
        return self.get(name) is not None

    def get(self, name, default=None):
        try:
            return self[name]
        except KeyError:
            return default


SCORERS: dict[str, Callable[[str, Any], Union[float, dict]]] = ScorerTable({
    **{name: gsm8k.compute_score for name in GSM8K_SOURCES},
    **{name: math_answers.compute_score for name in MATH_SOURCES},
    **{name: math_dapo.compute_score for name in DAPO_SOURCES},
})


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: Optional[dict] = None) -> Union[float, dict]:
    """The built-in score of one response: GSM8K (`#### answer`, strict), MATH (`\\boxed{}`) or
    DAPO (`Answer: ...`, a dict with score, acc and pred)."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no built-in reward for data_source={data_source!r} (built in: {sorted(SCORERS)}); "
            f"set reward.custom_fn, or route it with reward.route_by / reward.routes")
    return scorer(solution_str, ground_truth)
