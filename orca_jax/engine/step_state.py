"""One step's state: what the scheduler planned for it (`SchedulerOutput`, a `ScheduledRequest`
per request) and, once dispatched, its record among the steps in flight (`StepsInFlight`). No jax.

A step is planned by the scheduler (scheduler.py), built into a plan and dispatched by the engine
(engine.py), and collected when its result is needed. Between dispatch and collect it is in flight,
and `StepsInFlight` is the one record of that: the steps in dispatch order with the runner's handle
of each, and for every request the newest step in flight that holds it. The engine pushes a step
when the runner has taken it and pops the oldest before it collects it; the scheduler asks it
which requests are in flight (never planned again, never preempted) and, with async scheduling,
which step a request's next step continues.

How many steps may be in flight is decided here too (`StepsInFlight.for_engine`): the pipeline's
depth (Orca's batches in flight: each step takes about 1/depth of the running requests), or with
one stage and async scheduling two, the newer continuing the older's requests on tokens the
runner feeds on the device (`plans_ahead`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from typing import Any, Iterator, NamedTuple

from orca_jax.config import EngineConfig
from orca_jax.engine.request import Request


@dataclasses.dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens (drafts included)
    start: int  # request.num_computed_tokens when scheduled
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)  # verified after the request's last token
    proposes: bool = False  # the device proposes drafts for the request's next step
    # Async scheduling: planned ahead of its step in flight, its one token is the token that step
    # samples at this logit row (fed on the device); -1: its tokens are known here
    fed_from_row: int = -1
    row: int = -1  # its first logit row in the step's plan (set when the plan is built)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token, so a new one is sampled."""
        return self.fed_from_row >= 0 or (
            self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)
    num_padding_seqs: int = 0  # static policy: finished members that still occupy batch rows

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(s.draft_token_ids) for s in self.scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled) + self.num_padding_seqs

    @property
    def empty(self) -> bool:
        return not self.scheduled


class StepInFlight(NamedTuple):
    """A dispatched step whose result is not back yet."""

    scheduled: SchedulerOutput
    pending: Any  # the runner's handle, for `collect`


class StepsInFlight:
    """The dispatched steps not yet collected, oldest first (see the module docstring)."""

    def __init__(self, depth: int = 1, plans_ahead: bool = False, max_seqs_per_step: int | None = None):
        self.depth = depth  # steps dispatched at once
        # Async scheduling: the scheduler plans a request's next step while its step is in flight
        # (scheduler.py); the runner must feed sampled tokens
        self.plans_ahead = plans_ahead
        self.max_seqs_per_step = max_seqs_per_step  # requests one step takes (None: no cap)
        self.depths: Counter[int] = Counter()  # steps in flight right after each dispatch
        self._steps: deque[StepInFlight] = deque()
        self._newest: dict[int, ScheduledRequest] = {}  # id(request) -> its newest step in flight's entry

    @classmethod
    def for_engine(cls, config: EngineConfig, pipeline_depth: int, feeds_sampled_tokens: bool) -> "StepsInFlight":
        """The steps an engine keeps in flight with a runner of `pipeline_depth` stages in flight
        (runner.max_in_flight) that does or does not feed sampled tokens on the device."""
        spec = config.speculative_config
        # Async scheduling: one stage, a runner that feeds sampled tokens, and no draft model (its
        # drafts come from a program of its own after each step; n-gram drafts hold back only the
        # steps that verify them: scheduler.py)
        plans_ahead = (config.scheduler.async_scheduling and pipeline_depth == 1
                       and (spec is None or spec.method == "ngram") and feeds_sampled_tokens)
        # With a pipeline of depth d, each step takes about 1/d of the running requests.
        per_step = -(-config.scheduler.max_num_seqs // pipeline_depth)
        return cls(2 if plans_ahead else pipeline_depth, plans_ahead, per_step)

    # ---- the engine: dispatch and collect ---------------------------------------------------
    @property
    def has_room(self) -> bool:
        return len(self._steps) < self.depth

    def push(self, scheduled: SchedulerOutput, pending: Any) -> None:
        """Records a step the runner has taken."""
        self._steps.append(StepInFlight(scheduled, pending))
        for planned in scheduled.scheduled:
            self._newest[id(planned.request)] = planned
        self.depths[len(self._steps)] += 1

    def pop_oldest(self) -> StepInFlight:
        """Takes the oldest step off the record, before its result is collected."""
        step = self._steps.popleft()
        for planned in step.scheduled.scheduled:
            if self._newest.get(id(planned.request)) is planned:
                del self._newest[id(planned.request)]
        return step

    # ---- the scheduler: who is in flight ---------------------------------------------------
    def holds(self, request: Request) -> bool:
        """Whether a step in flight holds the request."""
        return id(request) in self._newest

    def newest(self, request: Request) -> ScheduledRequest | None:
        """The request's entry in its newest step in flight (None: it is in none)."""
        return self._newest.get(id(request))

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[StepInFlight]:
        return iter(self._steps)

    def __getitem__(self, index: int) -> StepInFlight:
        return self._steps[index]
