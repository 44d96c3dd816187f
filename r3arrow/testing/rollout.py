"""A toy environment for rollout loops in tests, the demo and users' own tests.

`ArithmeticEnv` is an `r3arrow.rollout.Environment` (needs the ``client`` extra, as
`r3arrow.rollout` does).
"""

from __future__ import annotations

from collections.abc import Sequence

from r3arrow._checks import check_int, check_nonnegative_int, check_positive_int
from r3arrow.rollout import Conversation, Step


class ArithmeticEnv:
    """Deterministic toy environment whose observations and rewards depend on what was generated.

    After each turn the observation is ``observation_len`` tokens counting on from the last
    generated token (``last + 1, last + 2, ...`` mod ``vocab_size``); the step reward is 1.0
    when the turn's generated tokens sum to an even number, else 0.0, so sampled groups get
    varied rewards (dynamic sampling keeps some and drops others). Done after ``turns`` turns.
    """

    def __init__(self, *, vocab_size: int, turns: int = 3, observation_len: int = 3) -> None:
        self.vocab_size = check_int(vocab_size, "vocab_size", minimum=2)
        self.turns = check_positive_int(turns, "turns")
        self.observation_len = check_nonnegative_int(observation_len, "observation_len")

    def observation(self, generated: Sequence[int]) -> list[int]:
        last = int(generated[-1])
        return [(last + 1 + i) % self.vocab_size for i in range(self.observation_len)]

    def step(self, conversation: Conversation) -> Step:
        gen = conversation.last_generated
        reward = 1.0 if sum(gen) % 2 == 0 else 0.0
        if conversation.num_turns >= self.turns:
            return Step(reward=reward, done=True)
        return Step(observation_tokens=self.observation(gen), reward=reward)


__all__ = ["ArithmeticEnv"]
