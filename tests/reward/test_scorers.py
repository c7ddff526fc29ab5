"""GSM8K, MATH and DAPO answer checking with reward.math_compat=lenient on tables of tricky
cases, and the data_source dispatch.

Each row's comment gives what verl's own scorer (verl/utils/reward_score: gsm8k.py, math_reward.py,
math_dapo.py) returns for it: "verl: <value>" where lenient agrees, and "ours ... verl ... because
..." where it differs on purpose (the module docstrings list why). math_compat=verl is checked
against verl itself in test_verl_parity.py (these rows are among its cases).
"""
import pytest

from verl_mcore.reward import default_compute_score
from verl_mcore.reward import gsm8k, math_answers, math_dapo
from verl_mcore.reward.builtin import SCORERS
from verl_mcore.reward.scorers import check_result

# (response, ground truth, strict score, flexible score); verl: (strict, flexible)
GSM8K_CASES = [
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0, 1.0),  # verl: (1, 1)
    ("#### 1,000", "1000", 1.0, 1.0),  # ours (1, 1) verl (1, 0) because its flexible keeps commas
    # ours (1, 1) verl (0, 0): verl needs a digit right after "#### " and keeps the final "."
    ("The total is $1,000.\n#### $1,000.", "1000", 1.0, 1.0),
    ("#### 18 dollars", "18", 1.0, 1.0),                   # verl: (1, 1)
    ("#### 18.00", "18", 1.0, 1.0),  # ours (1, 1) verl (0, 0) because verl compares strings
    ("#### -3", "-3", 1.0, 1.0),                           # verl: (1, 1)
    ("#### 0.5", ".5", 1.0, 1.0),    # ours (1, 1) verl (0, 0) because verl compares strings
    ("#### .5", ".5", 1.0, 1.0),                           # verl: (1, 1)
    ("She has 72 clips in total.", "72", 0.0, 1.0),        # verl: (0, 1): no ####
    ("#### 71\nwait, #### 72", "72", 1.0, 1.0),            # verl: (1, 1): the last #### counts
    ("#### 72\nActually it is 70 for 2 days", "72", 1.0, 0.0),  # verl: (1, 0): flexible sees 2
    ("I don't know.", "72", 0.0, 0.0),                     # verl: (0, 0)
    # ours (1, 1) verl (0, 0) because verl 0.9.1 reads only the last 300 characters
    ("#### 72\n" + "and that is the answer. " * 17, "72", 1.0, 1.0),
    ("####72", "72", 0.0, 1.0),                            # verl: (0, 1): no space, not the format
    ("####  72", "72", 0.0, 1.0),                          # verl: (0, 1): two spaces
    ("#### 7.2", "72", 0.0, 0.0),                          # verl: (0, 0)
    ("#### 72.", "72", 1.0, 1.0),    # ours (1, 1) verl (0, 0) because verl keeps the final "."
    ("the answer is 72.", "72", 0.0, 1.0),  # ours (0, 1) verl (0, 0): verl's number is "72."
    ("#### 1.2.3", "1.2", 0.0, 0.0),                       # verl: (0, 0): not a number
    ("#### 4,5", "45", 0.0, 0.0),  # ours (0, 0) verl (1, 0) because verl's strict drops commas
    ("#### 72", 72, 1.0, 1.0),       # ours (1, 1) verl (0, 0) because "72" != 72 there
]


@pytest.mark.parametrize("response,truth,strict,flexible", GSM8K_CASES)
def test_gsm8k_table(response, truth, strict, flexible):
    assert gsm8k.compute_score(response, truth, method="strict", compat="lenient") == strict
    assert gsm8k.compute_score(response, truth, method="flexible", compat="lenient") == flexible


def test_gsm8k_format_score_and_extraction():
    assert gsm8k.compute_score("#### 5", "6", format_score=0.1, compat="lenient") == 0.1
    assert gsm8k.compute_score("no number", "6", format_score=0.1, compat="lenient") == 0.0
    # verl: 0.1 there, a lone "." or "," counts as an answer; ours 0.0, it is no number
    assert gsm8k.compute_score("Hello, world.", "6", "flexible", format_score=0.1,
                               compat="lenient") == 0.0
    assert gsm8k.extract_answer("x #### $1,234.", "strict", compat="lenient") == "$1,234"
    assert gsm8k.extract_answer("a 3 b 4.5 c", "flexible", compat="lenient") == "4.5"
    assert gsm8k.extract_answer("x #### 1,234.", "strict") == "1234."  # verl's
    assert gsm8k.extract_answer("so . and ,", "flexible") == ","  # verl's: a lone "," counts


BOXED_CASES = [
    (r"The answer is $\boxed{\frac{1}{2}}$.", r"\frac12", 1.0),   # verl: 1
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),                 # verl: 1
    (r"\boxed{\tfrac{3}{4}}", "0.75", 1.0),  # ours 1 verl 0 because we compare numbers by value
    (r"\boxed{3/4}", r"\frac{3}{4}", 1.0),                          # verl: 1
    (r"\boxed{1/2}", "0.5", 1.0),                                   # verl: 1
    (r"\boxed{\frac{2}{4}}", r"\frac12", 1.0),  # ours 1 verl 0 because of value equality
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\dfrac{\sqrt3}{2}", 1.0),     # verl: 1 (nested braces)
    (r"\boxed{\{1, 2\}}", r"\{1,2\}", 1.0),                         # verl: 1
    (r"\boxed{x^{2}+\frac{1}{x^{2}}}", r"x^{2}+\frac{1}{x^{2}}", 1.0),  # verl: 1
    (r"\boxed{x^2 + 1}", "x^2+1", 1.0),                             # verl: 1
    (r"first \boxed{2}, then correcting: \boxed{3}", "3", 1.0),     # verl: 1 (the last box)
    (r"first \boxed{3}, then correcting: \boxed{2}", "3", 0.0),     # verl: 0
    (r"\boxed{\boxed{5}}", "5", 1.0),                               # verl: 1
    (r"\boxed{5 \text{ cm}}", "5", 1.0),                            # verl: 1
    (r"\boxed{5\text{ cm}^2}", "5", 1.0),                           # verl: 1
    (r"\boxed{12 \text{ square feet}}", "12", 1.0),                 # verl: 1
    (r"\boxed{5 \text{ cm}}", r"5\text{ km}", 1.0),                 # verl: 1 (units not compared)
    (r"\boxed{10 \text{ days}}", "10", 1.0),                        # verl: 1
    (r"\boxed{12\mbox{ inches}}", "12", 1.0),  # ours 1 verl 0 because verl strips only \text{ }
    (r"\boxed{18 dollars}", "18", 1.0),  # ours 1 verl 0 because verl keeps plain-word units
    # The false positive of issue 19: the answer names two numbers, the first must not win.
    (r"\boxed{2 and 3}", "2", 0.0),                                 # verl: 0
    (r"\boxed{2, 3}", "2", 0.0),                                    # verl: 0
    (r"\boxed 2 and 3", "2", 0.0),                                  # verl: 0
    (r"\boxed{2 \text{ and } 3}", "2", 0.0),  # ours 0 verl 1 because verl cuts at "\text{ "
    (r"\boxed{3 \text{ or } 4}", "3", 0.0),   # ours 0 verl 1, the same cut
    (r"\boxed{5 \text{ or more}}", "5", 0.0),  # ours 0 verl 1, the same cut
    (r"\boxed{12 \text{ apples}}", "12", 0.0),  # ours 0 verl 1: "apples" is no unit we know
    (r"\boxed{5 \text{ m}}", "5", 0.0),  # ours 0 verl 1: one-letter units read as variables
    (r"\boxed{2x}", "2", 0.0),                                      # verl: 0
    (r"\boxed{90^\circ}", "90", 1.0),                               # verl: 1
    (r"\boxed{90^{\circ}}", "90", 1.0),                             # verl: 1
    (r"\boxed{\$5}", "5", 1.0),                                     # verl: 1
    (r"\boxed{\$1,000}", "1000", 1.0),  # ours 1 verl 0 because verl keeps thousands commas
    (r"\boxed{1,000}", "1,000", 1.0),                               # verl: 1
    (r"\boxed{1\!000}", "1000", 1.0),                               # verl: 1
    (r"\boxed{1\,000}", "1000", 1.0),  # ours 1 verl 0 because we drop LaTeX spacing \,
    (r"\boxed{50\%}", "50", 1.0),                                   # verl: 1
    (r"\boxed{50%}", "50", 1.0),  # ours 1 verl 0 because verl drops only an escaped \%
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),                 # verl: 1
    (r"\boxed{[1, 2)}", "[1,2)", 1.0),                              # verl: 1 (an interval)
    (r"\boxed{(1,2)}", "(2,1)", 0.0),                               # verl: 0
    (r"\boxed{(-\infty, 2]}", r"(-\infty,2]", 1.0),                 # verl: 1
    (r"\boxed{x = 4}", "4", 1.0),                                   # verl: 1
    (r"\boxed{\text{(B)}}", "(B)", 1.0),  # ours 1 verl 0 because verl keeps \text{} wrappers
    (r"\boxed{\text{(B)}}", r"\text{(B)}", 1.0),                    # verl: 1
    (r"\boxed 7", "7", 1.0),                                        # verl: 1
    (r"$\boxed 7$ is the answer", "7", 1.0),                        # verl: 1 (up to the `$`)
    (r"\boxed 7, and later \boxed{3}", "3", 1.0),  # ours 1 verl 0: a `\boxed ` wins there
    (r"\fbox{7}", "7", 1.0),  # ours 1 verl 0 because verl's \fbox fallback fails an assertion
    (r"The answer is 7.", "7", 0.0),                                # verl: 0 (no box)
    (r"\boxed{\frac{1}{2}", r"\frac{1}{2}", 0.0),                   # verl: 0 (cut off)
    (r"\boxed{}", "0", 0.0),                                        # verl: 0 (empty box)
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),  # ours 1 verl 0 because of value equality
    (r"\boxed{0.5}", ".5", 1.0),                                    # verl: 1
    (r"\boxed{5.}", "5", 1.0),  # ours 1 verl 0 because verl keeps a trailing period
    (r"\boxed{- 3}", "-3", 1.0),                                    # verl: 1
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),                          # verl: 0
    (r"\boxed{5}", 5, 1.0),  # ours 1 verl 0 because verl's normalisation fails on an int
]


@pytest.mark.parametrize("response,truth,expected", BOXED_CASES)
def test_math_table(response, truth, expected):
    assert math_answers.compute_score(response, truth, compat="lenient") == expected


def test_math_ground_truth_may_be_a_boxed_solution():
    assert math_answers.compute_score(r"\boxed{6}", r"so $x=\boxed{6}$.", compat="lenient") == 1.0
    assert math_answers.compute_score(r"\boxed{6}", r"so $x=\boxed{6}$.") == 0.0  # verl


# (response, ground truth, score, pred); verl returns the same dict unless a comment says not
DAPO_CASES = [
    ("so we get 5.\nAnswer: 5", "5", 1.0, "5"),
    ("answer :  5", "5", 1.0, "5"),                        # any case, spaces around the colon
    ("Final Answer: 5", "5", 1.0, "5"),
    ("Answer:\n5", "5", 1.0, "5"),                         # the space after ":" may be a newline
    ("Answer: 4\nno wait\nAnswer: 5", "5", 1.0, "5"),      # the last Answer: line
    (r"so \boxed{5}", "5", 1.0, "5"),                      # no Answer: line: the last box (verl 0.9.1)
    (r"\boxed{4} then \boxed{5}", "5", 1.0, "5"),
    (r"so \boxed{ 5}", "5", -1.0, " 5"),                   # ... compared unnormalised
    ("Answer: 4\n" + r"\boxed{5}", "5", -1.0, "4"),       # an Answer: line wins over a box
    (r"\boxed{5}" + "x" * 100, "5", -1.0, "[INVALID]"),    # a box outside the last 100 characters
    ("Answer: 5 " + "x" * 300, "5", -1.0, "[INVALID]"),    # outside the last 300 characters
    (r"Answer: $\frac{1}{2}$", r"\frac12", 1.0, r"\frac{1}{2}"),
    ("Answer: 1/2", r"\frac{1}{2}", -1.0, "1/2"),         # no a/b rule
    (r"Answer: \dfrac{3}{4}", r"\frac{3}{4}", -1.0, r"\dfrac{3}{4}"),
    ("Answer: 1,000", "1000", 1.0, "1000"),
    ("Answer: -1,000", "-1000", -1.0, "-1,000"),           # only digits and commas lose commas
    ("Answer: 3, 4", "34", -1.0, "3,4"),  # ours -1 verl +1 because verl drops any comma in digits
    (r"Answer: \$5", "5", 1.0, "5"),
    ("Answer: 12 square inches", "12", 1.0, "12"),
    (r"Answer: 5 \text{ cm}^2", "5", 1.0, "5"),
    (r"Answer: 5\text{ m}", "5", 1.0, "5"),
    ("Answer: 60 kmph", "60k", 1.0, "60k"),               # words go as substrings: "mph"
    (r"Answer: 90^\circ", "90", 1.0, "90"),
    (r"Answer: 50\%", "50", -1.0, r"50\%"),                # "%" is not removed
    ("Answer: 5.", "5", -1.0, "5."),
    ("Answer: x = 5", "5", 1.0, "5"),
    ("Answer: 2 and 3", "2", -1.0, "2and3"),
    ("Answer: $2$ and $3$", "2", 1.0, "2"),                # verl keeps the first math span
    ("Answer: x = 2 or x = 3", "3", 1.0, "3"),             # ... and what follows the last "="
    ("Answer: The final answer is $5$. I hope it is correct.", "5", 1.0, "5"),
    (r"Answer: \text{(B)}", "(B)", 1.0, "(B)"),
    (r"Answer: \boxed{7}", "7", 1.0, "7"),
    (r"Answer: 3\sqrt2", r"3\sqrt{2}", 1.0, r"3\sqrt{2}"),
    ("Answer: 5", 5, 1.0, "5"),  # ours +1, verl raises: it calls str methods on the int
]


@pytest.mark.parametrize("response,truth,score,pred", DAPO_CASES)
def test_dapo_table(response, truth, score, pred):
    assert math_dapo.compute_score(response, truth, compat="lenient") == {
        "score": score, "acc": score > 0, "pred": pred}


@pytest.mark.parametrize("response,truth,score,pred", [
    (r"... \boxed{5}", "5", 1.0, "5"),
    (r"\boxed{5}" + "x" * 100, "5", -1.0, None),          # outside the last 100 characters
    (r"\boxed{ 5}", "5", -1.0, " 5"),                      # no normalisation at all
    (r"\fbox{5}", "5", -1.0, None),                        # only \boxed{...}
    ("Answer: 5", "5", -1.0, None),
])
def test_dapo_strict_box(response, truth, score, pred):  # verl: the same dicts
    assert math_dapo.compute_score(response, truth, strict_box_verify=True) == {
        "score": score, "acc": score > 0, "pred": pred}


def test_dapo_result_passes_the_check_with_acc_as_a_metric():
    assert check_result(math_dapo.compute_score("Answer: 5", "5")) == (1.0, {"acc": 1.0})
    assert check_result(math_dapo.compute_score("Answer: 4", "5")) == (-1.0, {"acc": 0.0})


# verl's default_compute_score: the same names reach the same kind of scorer
@pytest.mark.parametrize("source", ["openai/gsm8k"])
def test_dispatch_gsm8k(source):
    assert default_compute_score(source, "#### 72", "72") == 1.0
    assert default_compute_score(source, "#### 71", "72", extra_info={"split": "test"}) == 0.0


@pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                                    "HuggingFaceH4/MATH-500"])
def test_dispatch_math(source):
    assert default_compute_score(source, r"\boxed{\dfrac12}", "0.5") == 1.0


@pytest.mark.parametrize("source", ["math_dapo", "math", "math_dapo_reasoning", "aime24",
                                    "aime_2025", "aime"])
def test_dispatch_dapo(source):
    assert default_compute_score(source, "Answer: 12", "12")["score"] == 1.0
    assert default_compute_score(source, r"\boxed{12}", "12")["score"] == 1.0  # verl 0.9.1's box fallback
    assert default_compute_score(source, "12", "12")["score"] == -1.0
    assert source in SCORERS


@pytest.mark.parametrize("source", ["my/data", "gsm8k", "lighteval/MATH-Hard", "Math", "xaime"])
def test_dispatch_unknown_source(source):  # verl: NotImplementedError for each of these too
    assert source not in SCORERS and SCORERS.get(source) is None
    with pytest.raises(NotImplementedError, match=f"data_source='{source}' \\(built in.*reward.custom_fn"):
        default_compute_score(source, "x", "y")


@pytest.mark.parametrize("source,verl_scorer", [("numina_olympiads", "prime_math"), ("taco", "sandbox"),
                                                ("hiyouga/geometry3k", "geo3k"),
                                                ("searchR1_nq", "search_r1_like_qa_em")])
def test_dispatch_source_only_verl_scores_names_verls_scorer(source, verl_scorer):
    """verl 0.9.1 scores these with scorers we do not build in: the error says which."""
    assert source not in SCORERS
    with pytest.raises(NotImplementedError, match=f"verl scores {source} -> verl's {verl_scorer}"):
        default_compute_score(source, "x", "y")


def test_dispatch_table_is_verls():
    assert sorted(SCORERS) == sorted([
        "openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500", "math_dapo", "math", "math_dapo_reasoning", "aime*"])
    assert None not in SCORERS and 3 not in SCORERS  # a missing or odd data_source column


@pytest.mark.parametrize("value,expected", [(1, (1.0, {})),
                                            ({"score": 0.5, "acc": True, "note": "x"},
                                             (0.5, {"acc": 1.0}))])
def test_check_result_accepts(value, expected):
    assert check_result(value) == expected


@pytest.mark.parametrize("value,problem", [({"acc": 1}, "without 'score'"), ("high", "got str"),
                                           (float("nan"), "must be a finite number"), (None, "got NoneType"),
                                           (True, "got bool")])
def test_check_result_refuses(value, problem):
    with pytest.raises((TypeError, ValueError), match=problem):
        check_result(value)
