"""The built-in rule scorers, dispatched by the sample's `data_source`."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

from verl_mcore.reward import gsm8k, math_answers

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
                "lighteval/MATH-Hard", "hendrycks/competition_math", "EleutherAI/hendrycks_math",
                "math")

SCORERS: dict[str, Callable[[str, Any], float]] = {
    **{name: gsm8k.compute_score for name in GSM8K_SOURCES},
    **{name: math_answers.compute_score for name in MATH_SOURCES},
}


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: Optional[dict] = None) -> Union[float, dict]:
    """The built-in score of one response: GSM8K (`#### answer`, strict) or MATH (`\\boxed{}`)."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no built-in reward for data_source={data_source!r} (built in: {sorted(SCORERS)}); "
            f"set reward.custom_fn, or route it with reward.route_by / reward.routes")
    return scorer(solution_str, ground_truth)
