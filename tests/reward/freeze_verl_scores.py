"""Fill in verl 0.9.1's scores of the cases in verl_cases.json by running verl's own scorers.

    pip download --no-deps verl==0.9.1 -d /tmp/verlpkg
    python tests/reward/freeze_verl_scores.py /tmp/verlpkg/verl-0.9.1-py3-none-any.whl          # rewrite
    python tests/reward/freeze_verl_scores.py /tmp/verlpkg/verl-0.9.1-py3-none-any.whl --check  # compare

CI has no verl, so test_verl_parity.py compares our `reward.math_compat=verl` scorers with the
values frozen here. To add a case, append {data_source, response, ground_truth, origin} (and
`kwargs` for a scorer's own keyword arguments, e.g. {"method": "flexible"}) to the JSON and run
this tool: it writes each case's
  verl              what verl returns: default_compute_score(data_source, response, ground_truth)
                    without kwargs, else the data source's scorer module's compute_score(response,
                    ground_truth, **kwargs) (gsm8k, math_reward, math_dapo); {"raises": name} when
                    verl raises
  verl_math_verify  MATH sources, when math-verify is installed: the score of verl's
                    reward_score/math_verify.py, whose check (_verify_in_subprocess) is run here
                    directly; verl runs it in a spawned process pool and scores an exception or a
                    timeout 0, and so does this tool
`lenient_differs` (set by hand) names the entry of the lenient scorer's docstring that explains
why math_compat=lenient scores the case differently from verl.

Only verl/utils/reward_score is imported from the wheel: verl's own package __init__ (torch, ray,
...) is replaced by empty packages, and verl.utils.import_utils by a stub of its `deprecated`.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import types
import zipfile

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verl_cases.json")
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")


def import_verl_scorers(root: str) -> types.ModuleType:
    """verl.utils.reward_score from an unzipped wheel at `root`, without verl's heavy imports."""
    for name, path in [("verl", "verl"), ("verl.utils", "verl/utils")]:
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, path)]
        sys.modules[name] = package
    stub = types.ModuleType("verl.utils.import_utils")
    stub.deprecated = lambda *args, **kwargs: (lambda fn: fn)
    sys.modules["verl.utils.import_utils"] = stub
    import importlib

    return importlib.import_module("verl.utils.reward_score")


def verl_result(scorers: types.ModuleType, case: dict):
    import importlib

    source, response, truth = case["data_source"], case["response"], case["ground_truth"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # math_reward prints what it catches
            if "kwargs" not in case:
                return scorers.default_compute_score(source, response, truth)
            module = ("gsm8k" if source == "openai/gsm8k" else
                      "math_reward" if source in MATH_SOURCES else "math_dapo")
            fn = importlib.import_module(f"verl.utils.reward_score.{module}").compute_score
            return fn(response, truth, **case["kwargs"])
    except Exception as e:  # recorded: our verl mode must raise too
        return {"raises": type(e).__name__}


def verl_math_verify_result(case: dict):
    """verl's math_verify.compute_score, its subprocess's check run in this process."""
    from verl.utils.reward_score import math_verify as verl_mv

    if not isinstance(case["ground_truth"], str):  # verl's "\\boxed{" + ground_truth raises
        return {"raises": "TypeError"}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return verl_mv._verify_in_subprocess("\\boxed{" + case["ground_truth"] + "}",
                                                 case["response"])
    except BaseException:  # math-verify's TimeoutException is a BaseException
        return 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("verl", help="verl 0.9.1's wheel, or the directory it was unzipped into")
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--check", action="store_true", help="compare; write nothing")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        root = args.verl
        if root.endswith(".whl"):
            root = stack.enter_context(tempfile.TemporaryDirectory())
            with zipfile.ZipFile(args.verl) as wheel:
                wheel.extractall(root, [n for n in wheel.namelist()
                                        if n.startswith("verl/utils/reward_score/")])
        scorers = import_verl_scorers(root)
        try:
            import math_verify  # noqa: F401
            has_math_verify = True
        except ImportError:
            has_math_verify = False
            print("math-verify is not installed: verl_math_verify values are kept as they are")
        with open(args.cases) as f:
            cases = json.load(f)
        changed = 0
        for i, case in enumerate(cases):
            new = dict(case, verl=verl_result(scorers, case))
            if has_math_verify and case["data_source"] in MATH_SOURCES and "kwargs" not in case:
                new["verl_math_verify"] = verl_math_verify_result(case)
            if new != case:
                changed += 1
                print(f"case {i}: {json.dumps(case.get('verl'))} -> {json.dumps(new['verl'])}"
                      f"  {case['data_source']} {case['response'][:60]!r} {case['ground_truth']!r}")
            cases[i] = new
    if args.check:
        print(f"{len(cases)} cases, {changed} differ from verl's scores here")
        return 1 if changed else 0
    with open(args.cases, "w") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"{len(cases)} cases written to {args.cases} ({changed} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
