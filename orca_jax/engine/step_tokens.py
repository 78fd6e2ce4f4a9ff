"""What one step gives each request back: its new tokens (with logprobs when asked), the drafts it
verified and the drafts proposed for its next step. The runner makes them (step_plan.step_tokens),
the scheduler and the engine consume them; no jax."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SampledToken:
    token: int
    logprob: float
    top: tuple[list[int], list[float]] | None  # top-N ids and logprobs, when the request asked


@dataclasses.dataclass
class StepTokens:
    """A request's result of one step: its new tokens (the accepted drafts, then the target's own
    token), the number of drafts it verified, and the drafts proposed for its next step."""

    tokens: list[SampledToken]
    num_drafts: int = 0
    next_drafts: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1
