"""The agent runtime's per-tool counts over several calls of one step (dynamic sampling samples
several generation batches a step): they add up in the step's metrics, where the per-batch
means keep the last call's value. A scripted server and phase, no model; milliseconds."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

from verl_mcore.agent.loop import AgentLoop
from verl_mcore.agent.runtime import AgentRuntime
from verl_mcore.generation import GenerationPhase
from verl_mcore.rollout.base import SampleOutput, SamplingParams


class _Server:
    """Every request gets one token (1) and stops there."""

    def __init__(self):
        self.pending, self.next_id = [], 0

    @property
    def busy(self):
        return bool(self.pending)

    def submit(self, request):
        self.next_id += 1
        self.pending.append((self.next_id, request))
        return self.next_id

    def release(self, session):
        pass

    def step(self):
        done, self.pending = self.pending, []
        return [(rid, SampleOutput(prompt_index=r.prompt_index, sample_index=r.sample_index,
                                   token_ids=[1], logprobs=None, finish_reason="stop"))
                for rid, r in done]


class _Phase:
    groups = SimpleNamespace(gen_tp=None)

    def __init__(self):
        self.noted = {}

    @contextlib.contextmanager
    def serving(self, sampling, max_len, sessions):
        yield _Server(), sampling

    def keep_for_check(self, *args):
        pass

    note = GenerationPhase.note


class _Tools:
    """Stand-in AgentTools: each trajectory's call counts one call of tool "t"."""

    def __init__(self):
        self.calls = 0

    def take_metrics(self):
        out, self.calls = {"agent/tool/t/calls": float(self.calls)}, 0
        return out


class _OneCall(AgentLoop):
    async def run(self, ctx, row, prompt_ids):
        await ctx.generate()
        ctx.tools.calls += 1


def test_tool_counts_add_up_over_a_steps_calls():
    rt = AgentRuntime(_OneCall, {}, None, "one_call", max_turns=2, tokenizer=None,
                      eos_token_ids=[0], vocab_size=8, tools=_Tools())
    phase = _Phase()
    prompts = SimpleNamespace(input_ids=[[2, 3], [4]], rows=[{}, {}])
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0)
    for _ in range(3):  # three generation batches before the step's metrics are taken
        assert len(rt(phase, prompts, sampling)) == 4
    assert phase.noted["agent/tool/t/calls"] == 12.0  # 3 batches x 4 trajectories
    assert phase.noted["agent/trajectories"] == 4.0  # a per-batch value: the last call's
