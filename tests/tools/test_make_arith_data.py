"""The arithmetic recipe's data maker (tools/make_arith_data.py) and reward
(examples/arith_reward.py): the files our trainer and TRL's both read in bench_real_model.py."""
import importlib.util
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tools import make_arith_data

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("arith_reward", ROOT / "examples" / "arith_reward.py")
arith_reward = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arith_reward)


def _question(row):
    return row["prompt"][0]["content"]


def test_splits_are_disjoint_complete_deterministic_and_right(tmp_path):
    paths = make_arith_data.main(["--out", str(tmp_path / "a"), "--seed", "3", "--val-rows", "20",
                                  "--max-operand", "9"])
    again = make_arith_data.main(["--out", str(tmp_path / "b"), "--seed", "3", "--val-rows", "20",
                                  "--max-operand", "9"])
    other = make_arith_data.main(["--out", str(tmp_path / "c"), "--seed", "4", "--val-rows", "20",
                                  "--max-operand", "9"])
    tables = {s: pq.read_table(p).to_pylist() for s, p in paths.items()}
    assert tables == {s: pq.read_table(p).to_pylist() for s, p in again.items()}
    assert [_question(r) for r in tables["val"]] != [_question(r) for r in pq.read_table(other["val"]).to_pylist()]
    # 81 sums and the 45 differences with a >= b: every one once, none in both splits.
    questions = [_question(r) for s in ("train", "val") for r in tables[s]]
    assert len(tables["val"]) == 20 and len(questions) == 81 + 45 == len(set(questions))
    for split, rows in tables.items():
        for i, row in enumerate(rows):
            e = row["extra_info"]
            assert (e["split"], e["index"], row["data_source"]) == (split, i, "arith")
            assert _question(row) == f"What is {e['a']} {e['op']} {e['b']}? Answer with only the number."
            answer = e["a"] + e["b"] if e["op"] == "+" else e["a"] - e["b"]
            assert row["reward_model"] == {"style": "rule", "ground_truth": str(answer)} and answer >= 0


def test_bad_sizes_name_the_flag():
    with pytest.raises(ValueError, match="--val-rows 126"):
        make_arith_data.splits(0, 126, 1, 9)  # all 126 problems: nothing left to train on
    with pytest.raises(ValueError, match="--train-rows 200"):
        make_arith_data.splits(0, 10, 1, 9, train_rows=200)
    with pytest.raises(ValueError, match="--min-operand 5 and --max-operand 2"):
        make_arith_data.problems(5, 2)


@pytest.mark.parametrize("response, correct, formatted", [
    ("25", 1, 1), (" 25.\n", 1, 1), ("12 + 13 = 25", 1, 1), ("(12+13) = 25.", 1, 1),
    ("24", 0, 1), ("12 + 13 = 24", 0, 1), ("-25", 0, 1),
    ("The answer is 25.", 0, 0), ("25\n\nThis is because 12 + 13 = 25", 0, 0),
    ("12 + 13 = 25 = 25 apples", 0, 0), ("twenty-five", 0, 0), ("", 0, 0), ("25!", 0, 0),
])
def test_reward_pays_the_right_answer_in_the_strict_format_only(response, correct, formatted):
    assert arith_reward.arith_score("arith", response, "25", {}) == {"score": float(correct),
                                                                     "format": float(formatted)}


def test_reward_reads_negative_truth_and_refuses_a_non_integer_one():
    assert arith_reward.arith_score("arith", "5 - 8 = -3", "-3")["score"] == 1.0
    with pytest.raises(ValueError, match=r"ground_truth '2\.5' of data_source 'arith'"):
        arith_reward.arith_score("arith", "2.5", "2.5", {"index": 4})
