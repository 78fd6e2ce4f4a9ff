"""How many draft tokens a request verifies each step, and the figures of speculation. Pure Python.

The runner proposes drafts on the device (runner/speculation.py) and returns them with each step's
tokens; the scheduler asks `DraftPolicy.num_drafts` how many of them a request verifies next (each
one is a token of compute and a KV slot). Speculation only pays while extra rows are nearly free:

- batch size: a step of more than `disable_by_batch_size` rows is compute-bound on a CPU (the
  native matmuls read each weight once for up to 8 rows; DESIGN.md: batch >= 16 for SmolLM2),
  where a draft row costs what a decode row costs. So the drafts of a step, all requests together,
  fill at most the rows its decodes leave below that size, and nobody drafts while that many
  requests decode;
- acceptance: each request keeps its own estimate of the chance that a draft is accepted (drafts
  are accepted as a chain, so a run of a accepted then a miss is a + 1 Bernoulli trials with a
  successes); it verifies the j drafts whose chance of all being accepted, rate^j, is at least
  MIN_CHAIN_ACCEPTANCE. A request whose drafts keep failing drops to none, and gets one draft every
  PROBE_INTERVAL steps so that its estimate can recover when its text turns repetitive.

A request with a grammar (structured outputs) verifies only the drafts its grammar allows in a row
(the scheduler asks the grammar), and each of its rows is masked by the grammar's state after the
drafts before it, so no draft and no token after one can break the grammar.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orca_jax.config import SpeculativeConfig
from orca_jax.engine.request import Request

MIN_CHAIN_ACCEPTANCE = 0.4  # a draft is verified when all drafts up to it are this likely to pass
PROBE_INTERVAL = 16  # steps between single probing drafts of a request whose drafts fail
# A new request's estimate starts at 3/4, worth four trials: an n-gram match is usually right (copying),
# and a request whose drafts fail gets down to none within a few steps.
PRIOR_ACCEPTED, PRIOR_TRIALS = 3, 4


@dataclass
class SpeculationStats:
    """vLLM's spec_decode figures: drafts (steps where a request verified drafts), draft tokens,
    accepted tokens, and accepted tokens by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step emitted on average: the accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class DraftPolicy:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)

    @property
    def lookahead(self) -> int:
        """KV slots past a step's tokens that the proposer writes while proposing: a draft model
        decodes k tokens ahead (runner/draft_model.py); n-grams write none."""
        return self.config.num_speculative_tokens if self.config.method == "draft_model" else 0

    def step_drafts(self, num_decoding: int) -> int:
        """The most drafts one step verifies, all its requests together, with `num_decoding` requests
        decoding: its rows (decodes + drafts) stay within disable_by_batch_size."""
        return max(0, self.config.disable_by_batch_size - num_decoding)

    def proposes(self, num_decoding: int) -> bool:
        """Whether the device should propose drafts after this step: a draft model's k decode steps
        cost compute, so not while the batch is too large to verify any (n-grams cost nothing)."""
        return self.config.method != "draft_model" or num_decoding < self.config.disable_by_batch_size

    def num_drafts(self, request: Request, budget: int, max_model_len: int) -> int:
        """Drafts `request` verifies in its next decode step, given `budget` draft rows left in the
        step (its tokens and `step_drafts` both bound it)."""
        if not request.draft_token_ids:
            return 0
        spec = request.speculation
        rate = (spec.accepted + PRIOR_ACCEPTED) / (spec.trials + PRIOR_TRIALS)
        wanted = 0
        while wanted < self.config.num_speculative_tokens and rate ** (wanted + 1) >= MIN_CHAIN_ACCEPTANCE:
            wanted += 1
        if wanted == 0 and spec.steps_since_probe >= PROBE_INTERVAL:
            wanted = 1
        # Never past what the request may still generate: the last accepted draft must leave room
        # for the target's own token after it.
        room = min(request.params.max_tokens - len(request.output_token_ids), max_model_len - request.num_tokens) - 1
        return max(0, min(wanted, len(request.draft_token_ids), budget, room))

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Takes in a decode step's outcome: `num_accepted` of its `num_drafts` drafts passed."""
        spec = request.speculation
        if num_drafts == 0:
            spec.steps_since_probe += 1
            return
        spec.steps_since_probe = 0
        spec.accepted += num_accepted
        spec.trials += num_accepted + (num_accepted < num_drafts)
        request.metrics.num_draft_tokens += num_drafts
        request.metrics.num_accepted_tokens += num_accepted
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.stats.accepted_per_position[position] += 1
