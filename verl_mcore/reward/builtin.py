"""The built-in rule scorers, dispatched by the sample's `data_source`.

The table holds the data_source names that verl's `default_compute_score` sends to the scorers we
have, and only those, so a dataset prepared for verl gets the same scorer here:
  GSM8K (`#### 72`, 1/0)    openai/gsm8k
  MATH (`\\boxed`, 1/0)     lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500
  DAPO (`Answer:`, +1/-1)  math_dapo, math, math_dapo_reasoning, and every name starting with aime
Any other name (`gsm8k`, `lighteval/MATH-Hard`, `EleutherAI/hendrycks_math`, ...) has no built-in
scorer, as in verl: route it to one with reward.routes, or set reward.custom_fn.

How they compare answers is reward.math_compat (`math_compat` here):
  verl         verl 0.9.1's scorers exactly (the default; tests/reward/verl_cases.json holds the
               cases checked against verl itself)
  lenient      answers equal in value or up to formatting are right; each module's docstring
               lists every way it differs from verl
  math_verify  MATH sources checked by the math-verify library as verl's math_verify.py does
               (mathverify.py); GSM8K and DAPO as `verl`: their formats are part of their reward

Unlike verl 0.9.1, which also scores the names in VERL_ONLY_SOURCES (Numina sets with its sympy
grader prime_math, code sets by running the code in a sandbox, geometry3k, Search-R1 exact
match), we build none of those in; the error for such a name says which verl scorer it meant.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

from verl_mcore.reward import gsm8k, math_answers, math_dapo, mathverify

MATH_COMPAT = ("verl", "lenient", "math_verify")  # reward.math_compat
# The numeric extras a built-in scorer may return beside its score: the DAPO scorer's "acc" (its
# "pred" is a string, which the reward manager does not keep). A group filter's metric can name
# no other extra of a reward scored by built-ins alone (RewardManager.extra_keys).
EXTRAS = frozenset({"acc"})
GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning", "aime*")
# data_source -> the verl 0.9.1 scorer (verl/utils/reward_score/) that would take it; not built in
VERL_ONLY_SOURCES = {
    **{name: "prime_math" for name in (
        "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
        "numina_cn_k12", "numina_olympiads")},
    **{name: "sandbox_fusion / prime_code (runs the response's code)"
       for name in ("codecontests", "apps", "codeforces", "taco")},
    "hiyouga/geometry3k": "geo3k",
    **{f"searchR1_{name}": "search_r1_like_qa_em" for name in (
        "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")},
}


def unknown_source_hint(names) -> str:
    """What verl would have scored some of `names` with (empty when none is verl's)."""
    known = sorted({f"{n} -> verl's {VERL_ONLY_SOURCES[n]}" for n in names
                    if isinstance(n, str) and n in VERL_ONLY_SOURCES})
    return (f" (verl scores {'; '.join(known)}: not built in here, so give it a reward.custom_fn "
            f"or a route)") if known else ""


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


def _math(response: str, ground_truth: Any, math_compat: str) -> float:
    if math_compat == "math_verify":
        return mathverify.compute_score(response, ground_truth)
    return math_answers.compute_score(response, ground_truth, compat=math_compat)


def _gsm8k(response: str, ground_truth: Any, math_compat: str) -> float:
    return gsm8k.compute_score(response, ground_truth, compat=math_compat)


def _dapo(response: str, ground_truth: Any, math_compat: str) -> dict:
    return math_dapo.compute_score(response, ground_truth, compat=math_compat)


# data_source -> scorer(response, ground_truth, math_compat)
SCORERS: dict[str, Callable[[str, Any, str], Union[float, dict]]] = ScorerTable({
    **{name: _gsm8k for name in GSM8K_SOURCES},
    **{name: _math for name in MATH_SOURCES},
    **{name: _dapo for name in DAPO_SOURCES},
})


def check_math_compat(math_compat: str) -> None:
    """Raise ValueError for an unknown value, ImportError when its package is missing."""
    if math_compat not in MATH_COMPAT:
        raise ValueError(f"reward.math_compat={math_compat!r}: one of {', '.join(MATH_COMPAT)}")
    if math_compat == "math_verify":
        mathverify.require()


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: Optional[dict] = None,
                          math_compat: str = "verl") -> Union[float, dict]:
    """The built-in score of one response: GSM8K (`#### answer`, strict), MATH (`\\boxed{}`) or
    DAPO (`Answer: ...`, a dict with score, acc and pred), compared as `math_compat` says (the
    module docstring; "verl", the default of reward.math_compat, gives verl 0.9.1's scores)."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no built-in reward for data_source={data_source!r}{unknown_source_hint([data_source])} "
            f"(built in: {sorted(SCORERS)}); set reward.custom_fn, or route it with "
            f"reward.route_by / reward.routes")
    check_math_compat(math_compat)
    return scorer(solution_str, ground_truth, math_compat)
