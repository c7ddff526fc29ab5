"""A multi-turn game environment (agent.environment): guess the number, with "higher" / "lower"
after each guess and reward 1 for finding it.

    agent:
      environment:
        path: examples/agent/guess_number.py
        name: GuessTheNumber
        kwargs: {max_guesses: 7}

The dataset row names the secret (examples/agent/data/guess_number.jsonl: extra_info.target,
extra_info.low, extra_info.high). Each model turn is one guess: the last integer it writes. A turn
without an integer costs a guess too, and the feedback says what is expected. The game ends on
the right number (reward 1.0) or when the guesses run out (reward 0.0).

Standard library only: the sandbox workers import this file.
"""
from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


class GuessTheNumber:
    def __init__(self, max_guesses: int = 7):
        if max_guesses < 1:
            raise ValueError(f"max_guesses={max_guesses}: at least one guess")
        self.max_guesses = max_guesses
        self.target = self.low = self.high = None
        self.guesses = 0

    def reset(self, row) -> str:
        info = row["extra_info"]
        self.target, self.low, self.high = int(info["target"]), int(info["low"]), int(info["high"])
        self.guesses = 0
        return (f"I am thinking of an integer from {self.low} to {self.high}. You have "
                f"{self.max_guesses} guesses. Answer with one number per turn.")

    def step(self, action_text: str) -> tuple[str, float, bool]:
        self.guesses += 1
        left = self.max_guesses - self.guesses
        found = _INTEGER.findall(action_text)
        if not found:
            feedback = "That is not a number. Answer with one integer."
        else:
            guess = int(found[-1])
            if guess == self.target:
                return f"Correct! The number is {self.target}.", 1.0, True
            if not self.low <= guess <= self.high:
                feedback = f"{guess} is outside {self.low} to {self.high}."
            else:
                feedback = f"{guess} is too {'low: go higher' if guess < self.target else 'high: go lower'}."
        if left == 0:
            return f"{feedback} No guesses left: the number was {self.target}.", 0.0, True
        return f"{feedback} {left} guess{'es' if left > 1 else ''} left.", 0.0, False
