"""What generation returns, shaped like vLLM's RequestOutput so users can switch. No jax."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when the sampled token is outside the top-N
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs; None unless logprobs asked
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: top-N plus the sampled one
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string, if one ended it


@dataclass
class RequestMetrics:
    """Seconds on time.monotonic()'s clock."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # served by the prefix cache
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted (each one a token gained without its own step)

    def snapshot(self) -> RequestMetrics:
        """A copy, for an output (the engine keeps updating its own). Every field is a number, so a
        shallow copy of the fields is the whole copy; made this way, it costs a third of
        dataclasses.replace (every output of every step takes one)."""
        copy = object.__new__(RequestMetrics)
        copy.__dict__.update(self.__dict__)
        return copy

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    per_sample_metrics: list[RequestMetrics] = field(default_factory=list)
