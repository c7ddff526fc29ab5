"""A group filter (rollout.group_filter): keep or drop each prompt group, with a reason.

    rollout:
      group_filter:
        path: examples/group_filter.py
        name: drop_uninformative
        kwargs: {max_truncated_fraction: 0.5}

It is called once per prompt group, after algorithm.filter_groups' built-in filter, as
fn(group, **kwargs), on the first training rank (which sends its decisions to the other ranks);
`group` is a verl_mcore.rollout.prompt_group.PromptGroup (row, responses, scores, extras, finish,
response_lengths: one value per sample). It returns True (keep), False (drop) or
(False, "reason"): dropped groups are counted in rollout/filter/dropped/<reason> and the step
samples more prompts in their place (algorithm.filter_groups.max_num_gen_batches).
"""


def drop_uninformative(group, max_truncated_fraction=1.0):
    """Drop a group when too many of its responses hit the length limit (their reward says
    little about the answer), or when every sample wrote the very same response."""
    truncated = sum(reason == "length" for reason in group.finish) / group.n
    if truncated > max_truncated_fraction:
        return False, "truncated"
    if group.n > 1 and len(set(group.responses)) == 1:
        return False, "identical_responses"
    return True
