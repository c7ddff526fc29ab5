"""A short environment for the GPU matrix and the tests: any prompt, two steps; each step's
feedback names the step, the reward is 1 for a turn of an even number of characters."""


class Counting:
    def __init__(self, steps: int = 2):
        self.steps, self.done = steps, 0

    def reset(self, row) -> str:
        self.done = 0
        return "count"

    def step(self, action_text: str):
        self.done += 1
        return f"step {self.done}", float(len(action_text) % 2 == 0), self.done >= self.steps
