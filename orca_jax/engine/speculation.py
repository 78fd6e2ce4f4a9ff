"""How many draft tokens a request verifies each step, and the figures of speculation. Pure Python.

The runner proposes drafts on the device (runner/speculation.py) and returns them with each step's
tokens; the scheduler asks `DraftPolicy.num_drafts` how many of them a request verifies next (each
one is a token of compute and a KV slot). Speculation only pays while extra rows are nearly free:

- batch size: a step of more than `disable_by_batch_size` rows is compute-bound on a CPU (the
  native matmuls read each weight once for up to 8 rows; docs/speculative-decoding.md, "When a
  request drafts"), where a draft row costs what a decode row costs. So the drafts of a step, all
  requests together, fill at most the rows its decodes leave below that size, and nobody drafts while
  that many requests decode;
- acceptance: each request keeps its own estimate of the chance that a draft is accepted (drafts
  are accepted as a chain, so a run of a accepted then a miss is a + 1 Bernoulli trials with a
  successes), counting recent steps most (the counts decay by DECAY each verifying step: a text
  copies in stretches, and the estimate must follow it in a few steps both ways). With rate r,
  verifying j drafts yields 1 + r + ... + r^j tokens on average for a step that costs
  1 + j * DRAFT_ROW_COST plain steps; one more draft raises the tokens per cost while its chance
  r^(j+1) exceeds DRAFT_ROW_COST times the tokens expected so far, so a request verifies drafts
  while that holds (a draft model's k passes are spent whether its drafts are verified or not, so
  the same rule holds for it). A request whose drafts keep failing (r below DRAFT_ROW_COST) drops to
  none, and gets one draft every PROBE_INTERVAL steps so that its estimate can recover when its
  text turns repetitive.

A request with a grammar (structured outputs) verifies only the drafts its grammar allows in a row
(the scheduler asks the grammar), and each of its rows is masked by the grammar's state after the
drafts before it, so no draft and no token after one can break the grammar.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orca_jax.config import SpeculativeConfig
from orca_jax.engine.request import Request

# What one draft row adds to a one-sequence decode step, as a fraction of that step: SmolLM2 f32 with
# the native matmuls (weights read once for up to 8 rows), 2 cores. AMD EPYC Zen 3 (AVX2 only),
# 2026-12-03: 32.6-35.2 ms with no draft and about +2.2 ms a draft up to 7 (7%) in one timing, 37.0
# -> 55.3 ms with 4 (12%) in another; Intel Xeon (AVX-512), 2026-12-02: +3-3.5 ms a draft on 36-42
# ms. The lower figure is taken. (A threshold of 0.4 on the chance of a whole chain, as before,
# drafted as if a row cost about half a step.)
DRAFT_ROW_COST = 0.07
PROBE_INTERVAL = 16  # steps between single probing drafts of a request whose drafts fail
# The counts' decay at each verifying step: a request whose drafts all fail, from the prior of 3/4
# (engine/request.py), verifies none after 8 steps; one whose probe passes drafts again at once.
DECAY = 0.8


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
        rate = spec.accepted / spec.trials
        wanted, expected_tokens = 0, 1.0
        while (wanted < self.config.num_speculative_tokens
               and rate ** (wanted + 1) >= DRAFT_ROW_COST * expected_tokens):
            wanted += 1
            expected_tokens += rate ** wanted
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
        spec.accepted = DECAY * spec.accepted + num_accepted
        spec.trials = DECAY * spec.trials + num_accepted + (num_accepted < num_drafts)
        request.metrics.num_draft_tokens += num_drafts
        request.metrics.num_accepted_tokens += num_accepted
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.stats.accepted_per_position[position] += 1
