"""A toy agent loop for the runtime tests: no tools; after each model turn it waits (asyncio,
a time that differs between trajectories, so their turns arrive at different rounds) and
appends fixed observation tokens. Its result records the turns the loop saw, to compare with
the trajectory the runtime built."""
import asyncio

from verl_mcore.agent.loop import AgentLoop

OBSERVATION = (7, 8, 9, 10)


class ToyLoop(AgentLoop):
    def __init__(self, turns: int = 3, per_turn: int = 4, sleep_s: float = 0.01, stagger: bool = True):
        self.turns, self.per_turn, self.sleep_s, self.stagger = turns, per_turn, sleep_s, stagger

    async def run(self, ctx, row, prompt_ids):
        seen = []
        for k in range(self.turns):
            before = ctx.token_ids
            turn = await ctx.generate(max_new_tokens=self.per_turn)
            seen.append((before, list(turn.token_ids), ctx.sampled - len(turn.token_ids)))
            if k + 1 < self.turns:
                # trajectories wait different times: their next turns join other rounds
                wait = self.sleep_s * (1 + (ctx.index * 7) % 3) if self.stagger else self.sleep_s
                await asyncio.sleep(wait)
                ctx.append_observation(OBSERVATION)
        return {"reward": float(len(seen)), "seen": seen}


class NotALoop:
    async def run(self, ctx, row, prompt_ids):
        return None


class Raises(AgentLoop):
    async def run(self, ctx, row, prompt_ids):
        await ctx.generate(max_new_tokens=2)
        raise KeyError("no such tool")


class Greedy(AgentLoop):
    """Asks for turns until the runtime ends it (max_turns or the token budget)."""

    async def run(self, ctx, row, prompt_ids):
        while True:
            await ctx.generate(max_new_tokens=3)
            ctx.append_observation([5] * 4)
