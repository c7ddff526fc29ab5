"""Reward of the search example (examples/agent/data/search_questions.jsonl; reward.custom_fn):
1 when the model's final answer holds the ground truth, else 0.

The response an agent loop hands to the reward holds the tool results too, so a result that
quotes the answer must earn nothing by itself: only the text after the last of `markers` (the
end of a tool turn: Qwen's </tool_response>, and the opener of the assistant turn that follows
a tool turn in ChatML templates) is read, or the whole text when none occurs. Comparison ignores
case and commas inside numbers ("1,208" = "1208").

Standard library only.
"""
import re

MARKERS = ("</tool_response>", "<|im_start|>assistant\n")


def _normal(text: str) -> str:
    return re.sub(r"(?<=\d),(?=\d)", "", text).lower()


def final_answer(response: str, markers=MARKERS) -> str:
    """The text after the last marker (the model's last turn)."""
    cut = max((response.rfind(m) + len(m) for m in markers if m in response), default=0)
    return response[cut:]


def contains_answer(data_source, solution_str, ground_truth, extra_info=None,
                    markers=MARKERS) -> float:
    return 1.0 if _normal(str(ground_truth)) in _normal(final_answer(solution_str, markers)) else 0.0
