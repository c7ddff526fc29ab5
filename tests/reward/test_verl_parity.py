"""reward.math_compat against verl 0.9.1's own scorers, on the cases of verl_cases.json.

Each case's `verl` is what verl 0.9.1 returned for it (freeze_verl_scores.py ran verl's code; CI
has no verl). math_compat=verl must return exactly that; math_compat=lenient may differ only on
cases whose `lenient_differs` names an entry of the scorer module's docstring ("- <name>: ...");
math_compat=math_verify must return `verl_math_verify`, the score of verl's math_verify.py.
"""
import json
import os
import sys
import threading

import pytest

from verl_mcore.config.schema import RewardConfig
from verl_mcore.reward import RewardManager, default_compute_score, gsm8k, math_answers, math_dapo
from verl_mcore.reward.builtin import GSM8K_SOURCES, MATH_COMPAT, MATH_SOURCES, SCORERS

with open(os.path.join(os.path.dirname(__file__), "verl_cases.json")) as f:
    CASES = json.load(f)


def _module(source):
    if source in GSM8K_SOURCES:
        return gsm8k
    return math_answers if source in MATH_SOURCES else math_dapo


def _score(case, compat):
    """What we return for the case, as verl was called: the dispatch, or the module with kwargs."""
    if "kwargs" in case:
        return _module(case["data_source"]).compute_score(
            case["response"], case["ground_truth"], **case["kwargs"], compat=compat)
    return default_compute_score(case["data_source"], case["response"], case["ground_truth"],
                                 math_compat=compat)


def _case_id(case):
    return f"{case['data_source']}:{case['response'][:40]!r}:{case['ground_truth']!r}"


def test_the_cases_cover_every_source_kind_and_come_from_verl_and_users():
    assert len(CASES) >= 80
    kinds = {("gsm8k" if c["data_source"] in GSM8K_SOURCES else
              "math" if c["data_source"] in MATH_SOURCES else "dapo") for c in CASES}
    assert kinds == {"gsm8k", "math", "dapo"}
    assert all(c["data_source"] in SCORERS for c in CASES)
    origins = {c["origin"] for c in CASES}
    assert any(o.startswith("verl tests/") for o in origins)
    assert {"issue 39", "as users write them"} <= origins
    assert all("verl" in c for c in CASES), "run freeze_verl_scores.py on the new cases"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_verl_compat_equals_verl(case):
    if isinstance(case["verl"], dict) and "raises" in case["verl"]:
        with pytest.raises(Exception):  # verl raises on it: so do we, with a message saying why
            _score(case, "verl")
        return
    assert _score(case, "verl") == case["verl"]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_lenient_differs_from_verl_only_where_its_docstring_says(case):
    try:
        ours = _score(case, "lenient")
    except Exception as e:
        ours = {"raises": type(e).__name__}
    why = case.get("lenient_differs")
    if why is None:
        assert ours == case["verl"]
    else:
        assert ours != case["verl"], f"lenient now agrees with verl: drop lenient_differs={why!r}"
        doc = _module(case["data_source"]).__doc__
        assert f"- {why}:" in doc, f"{why!r} is not a listed deviation of {_module(case['data_source']).__name__}"


def test_the_issues_examples_are_wrong_under_verl_and_right_under_lenient():
    for response, truth, source in [("#### 3.50", "3.5", "openai/gsm8k"),
                                    ("#### $72", "72", "openai/gsm8k"),
                                    ("#### 00072", "72", "openai/gsm8k"),
                                    (r"\boxed{12 square inches}", "12", "lighteval/MATH"),
                                    (r"\boxed{(C)}", r"\text{(C)}", "lighteval/MATH"),
                                    (r"\boxed{{5}}", "5", "lighteval/MATH"),
                                    (r"\boxed{5.}", "5", "lighteval/MATH")]:
        assert default_compute_score(source, response, truth) == 0.0  # verl, the default
        assert default_compute_score(source, response, truth, math_compat="lenient") == 1.0


def test_unknown_math_compat_is_refused():
    with pytest.raises(ValueError, match="math_compat='strict': one of verl, lenient, math_verify"):
        default_compute_score("openai/gsm8k", "#### 1", "1", math_compat="strict")


# ---- the choice reaches the scorers wherever they run -------------------------------------------

def _row(source, truth):
    return {"data_source": source, "reward_model": {"style": "rule", "ground_truth": truth}}


@pytest.mark.parametrize("num_workers", [0, 1])
def test_math_compat_reaches_the_scorers_in_process_and_in_workers(num_workers):
    """reward.math_compat is read by the manager for the dispatch and for routes to built-in
    scorers, and travels to the worker processes with the scorer specs."""
    responses = ["#### 3.50", r"\boxed{5.}", "Answer: 3,4", "#### 3.50"]
    rows = [_row("openai/gsm8k", "3.5"), _row("lighteval/MATH", "5"), _row("math_dapo", "34"),
            dict(_row("my/gsm8k-copy", "3.5"), kind="gsm")]
    routing = dict(route_by="kind", routes={"gsm": "openai/gsm8k"})
    got = {}
    for compat in ("verl", "lenient"):
        cfg = RewardConfig(num_workers=num_workers, math_compat=compat, **routing)
        with RewardManager.from_config(cfg) as m:
            got[compat] = m.score(responses, rows).scores
    assert got == {"verl": [0.0, 0.0, 1.0, 0.0], "lenient": [1.0, 1.0, -1.0, 1.0]}


def test_math_compat_default_is_verl_and_the_schema_offers_what_the_scorers_know():
    import typing

    assert RewardConfig().math_compat == "verl"
    hints = typing.get_type_hints(RewardConfig)
    assert typing.get_args(hints["math_compat"]) == MATH_COMPAT


# ---- math-verify ---------------------------------------------------------------------------------

MV_CASES = [c for c in CASES if "verl_math_verify" in c]


def test_math_verify_cases_were_frozen():
    assert len(MV_CASES) >= 80


@pytest.mark.parametrize("case", MV_CASES, ids=_case_id)
def test_math_verify_compat_equals_verls_math_verify(case):
    pytest.importorskip("math_verify")
    expected = case["verl_math_verify"]
    if isinstance(expected, dict):
        with pytest.raises(TypeError, match="needs a string"):
            _score(case, "math_verify")
        return
    assert _score(case, "math_verify") == expected


def test_math_verify_leaves_gsm8k_and_dapo_to_verl():
    pytest.importorskip("math_verify")
    assert default_compute_score("openai/gsm8k", "#### 3.50", "3.5", math_compat="math_verify") == 0.0
    assert default_compute_score("math_dapo", "Answer: 3,4", "34",
                                 math_compat="math_verify")["score"] == 1.0


def test_math_verify_outside_the_main_thread():
    """math-verify's limits use signal.alarm, which raises outside the main thread: there they
    are off, and the score is the same."""
    pytest.importorskip("math_verify")
    result = []
    thread = threading.Thread(target=lambda: result.append(default_compute_score(
        "lighteval/MATH", r"\boxed{\frac{1}{2}}", "0.5", math_compat="math_verify")))
    thread.start()
    thread.join()
    assert result == [1.0]


def test_math_verify_in_a_worker_process():
    pytest.importorskip("math_verify")
    cfg = RewardConfig(num_workers=1, math_compat="math_verify")
    with RewardManager.from_config(cfg) as m:
        out = m.score([r"so $\boxed{\frac{3}{4}}$", r"\boxed{0.7}", "#### 3.50"],
                      [_row("lighteval/MATH", "0.75"), _row("HuggingFaceH4/MATH-500", "0.75"),
                       _row("openai/gsm8k", "3.5")])
    assert out.scores == [1.0, 0.0, 0.0] and out.metrics["reward/errors"] == 0


def test_math_verify_missing_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify -> ImportError
    with pytest.raises(ImportError, match=r"reward.math_compat=math_verify needs the math-verify "
                                          r"package.*pip install 'verl_mcore\[math\]'"):
        default_compute_score("lighteval/MATH", r"\boxed{1}", "1", math_compat="math_verify")
    with pytest.raises(Exception, match="needs the math-verify package"):
        RewardManager.from_config(RewardConfig(num_workers=0, math_compat="math_verify"))
