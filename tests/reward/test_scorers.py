"""GSM8K and MATH answer checking on a table of tricky cases, and the data_source dispatch."""
import pytest

from verl_mcore.reward import default_compute_score
from verl_mcore.reward import gsm8k, math_answers
from verl_mcore.reward.scorers import check_result

# (response, ground truth, strict score, flexible score)
GSM8K_CASES = [
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0, 1.0),
    ("#### 1,000", "1000", 1.0, 1.0),                      # thousands separator
    ("The total is $1,000.\n#### $1,000.", "1000", 1.0, 1.0),  # dollar sign, trailing period
    ("#### 18 dollars", "18", 1.0, 1.0),                   # trailing unit
    ("#### 18.00", "18", 1.0, 1.0),                        # same value
    ("#### -3", "-3", 1.0, 1.0),                           # negative
    ("#### 0.5", ".5", 1.0, 1.0),
    ("She has 72 clips in total.", "72", 0.0, 1.0),        # no ####: strict finds nothing
    ("#### 71\nwait, #### 72", "72", 1.0, 1.0),            # the last #### counts
    ("#### 72\nActually it is 70 for 2 days", "72", 1.0, 0.0),  # flexible: the last number, 2
    ("I don't know.", "72", 0.0, 0.0),                     # no answer at all
    ("####72", "72", 1.0, 1.0),                            # no space
    ("#### 7.2", "72", 0.0, 0.0),
]


@pytest.mark.parametrize("response,truth,strict,flexible", GSM8K_CASES)
def test_gsm8k_table(response, truth, strict, flexible):
    assert gsm8k.compute_score(response, truth, method="strict") == strict
    assert gsm8k.compute_score(response, truth, method="flexible") == flexible


def test_gsm8k_format_score_and_extraction():
    assert gsm8k.compute_score("#### 5", "6", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no number", "6", format_score=0.1) == 0.0
    assert gsm8k.extract_answer("x #### $1,234.", "strict") == "$1,234"
    assert gsm8k.extract_answer("a 3 b 4.5 c", "flexible") == "4.5"


BOXED_CASES = [
    (r"The answer is $\boxed{\frac{1}{2}}$.", r"\frac12", 1.0),
    (r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0),                 # \dfrac
    (r"\boxed{\tfrac{3}{4}}", "0.75", 1.0),                         # value equality
    (r"\boxed{3/4}", r"\frac{3}{4}", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\dfrac{\sqrt3}{2}", 1.0),     # nested braces
    (r"\boxed{\{1, 2\}}", r"\{1,2\}", 1.0),                         # escaped braces inside
    (r"\boxed{x^{2}+\frac{1}{x^{2}}}", r"x^{2}+\frac{1}{x^{2}}", 1.0),
    (r"first \boxed{2}, then correcting: \boxed{3}", "3", 1.0),     # several \boxed: the last
    (r"first \boxed{3}, then correcting: \boxed{2}", "3", 0.0),
    (r"\boxed{5 \text{ cm}}", "5", 1.0),                            # trailing unit
    (r"\boxed{12\mbox{ inches}}", "12", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{\$1,000}", "1000", 1.0),                              # dollar, comma
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),                 # \left \right, spaces
    (r"\boxed{x = 4}", "4", 1.0),
    (r"\boxed{\text{(B)}}", "(B)", 1.0),                            # LaTeX wrapper
    (r"\boxed{2x}", "2", 0.0),                                      # a variable is not a unit
    (r"\boxed 7", "7", 1.0),
    (r"\fbox{7}", "7", 1.0),
    (r"The answer is 7.", "7", 0.0),                                # no \boxed at all
    (r"\boxed{\frac{1}{2}", r"\frac{1}{2}", 0.0),                   # cut off: unbalanced
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{0.5}", ".5", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
]


@pytest.mark.parametrize("response,truth,expected", BOXED_CASES)
def test_math_table(response, truth, expected):
    assert math_answers.compute_score(response, truth) == expected


def test_math_ground_truth_may_be_a_boxed_solution():
    assert math_answers.compute_score(r"\boxed{6}", r"so $x=\boxed{6}$.") == 1.0


@pytest.mark.parametrize("source", ["openai/gsm8k", "gsm8k"])
def test_dispatch_gsm8k(source):
    assert default_compute_score(source, "#### 72", "72") == 1.0
    assert default_compute_score(source, "#### 71", "72", extra_info={"split": "test"}) == 0.0


@pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                                    "HuggingFaceH4/MATH-500", "math"])
def test_dispatch_math(source):
    assert default_compute_score(source, r"\boxed{\dfrac12}", "0.5") == 1.0


def test_dispatch_unknown_source():
    with pytest.raises(NotImplementedError, match="data_source='my/data'.*reward.custom_fn"):
        default_compute_score("my/data", "x", "y")


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
