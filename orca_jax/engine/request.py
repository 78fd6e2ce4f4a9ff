"""Per-request state, owned by the scheduler. No jax."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from orca_jax.outputs import RequestMetrics
from orca_jax.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # an end-of-sequence token, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens reached
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED  # (a set made once: asked of every request several times a step)


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


@dataclass
class SpeculationState:
    """A request's record of its drafts (engine/speculation.py's estimate of their acceptance)."""

    # Drafts accepted, and trials (drafts accepted plus one per step whose chain ended in a rejected
    # draft), both decayed at each verifying step (engine/speculation.py). They start at the prior:
    # 3/4, worth two trials, as an n-gram match is usually right (copying).
    accepted: float = 1.5
    trials: float = 2.0
    steps_since_probe: int = 0  # decode steps without drafts since the last with


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed actually used (params.seed, or one the engine drew)
    eos_token_ids: frozenset[int]  # the model's end-of-sequence ids (ModelConfig.eos_token_ids)
    metrics: RequestMetrics  # times, preemptions and prefix-cache hits, as reported to the user
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)  # KV page ids, in order
    stop_reason: int | str | None = None  # the stop token or stop string that ended it
    grammar: Any = None  # structured_output.Grammar when the output is constrained: its state after the outputs
    # Speculative decoding: drafts the device proposed after this request's latest step (its next
    # step may verify some of them), and the record of how its drafts fared.
    draft_token_ids: list[int] = field(default_factory=list)
    speculation: SpeculationState = field(default_factory=SpeculationState)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without building the whole concatenation (the
        runner asks for a step's few new tokens of a long sequence every step)."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus every token it may generate: what Orca's reservation covers."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens that exist but have no K/V yet: 1 when decoding; more for a prompt (or, after a
        preemption, prompt + outputs) still to be prefilled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status.finished
