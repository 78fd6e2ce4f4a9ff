"""Iteration-level scheduling policies. Pure Python, no jax: `schedule()` returns a plan as data.

Each policy is a `Scheduler` class in `POLICIES` (name -> class; `make_scheduler` picks one by the
config's name). The engine asks its scheduler the policy's questions (`max_prompt_tokens`,
`releases_whole_batches`) and never names a policy, so a new policy is a class here plus its name
in the config's choice list (`config.SCHEDULING_POLICIES`).

One call plans one forward pass: which requests take part and how many of their tokens are computed
(1 for a decode, a whole prompt or a chunk of it for a prefill), under `max_num_seqs` requests and
`max_num_batched_tokens` tokens. After the runner has executed the plan, `update_after_step()`
advances the requests (computed tokens, pages, drafts); the engine then appends their new tokens,
decides which have finished and calls `finish()`.

The policies (docs/design.md, "The policies"):

- static: request-level batching (the FasterTransformer baseline of the Orca paper). A batch is
  admitted only into an empty engine; its prompts are prefilled first, then it decodes as one,
  keeping its shape until every member is done (finished members stay as padding rows); its
  results are released together.
- orca: admission every iteration, FCFS, while the reservation of prompt + max_tokens pages fits.
  Never preempts.
- paged (vLLM): admission while the prompt's pages fit; pages grow on demand; when they run out,
  the running request with the fewest computed tokens is preempted (its pages freed, recomputed
  later) and goes back to the head of the queue. A recompute longer than the token budget is
  done in budget-sized pieces (a prompt itself always fits: the engine checks at admission).
- chunked (Sarathi-Serve): like paged, but decodes are scheduled first and prompts are split into
  chunks that fill the rest of the token budget.

Under pipeline parallelism the engine keeps several steps in flight, recorded in one place
(`StepsInFlight`, step_state.py, which the scheduler reads as `self.in_flight`); a request in one of
them is skipped until its result is back, and is never chosen as a victim (a dispatched step is
writing its pages). Each step thus plans the requests the others do not hold, at most
`max_seqs_per_step` of them (Orca's batches for its n_workers: the running requests split into about
pp batches that take turns in the pipeline; without the cap the first step would take them all and
the other stages would idle).

Async scheduling (vLLM's `async_scheduling`, one stage only): the next step is planned and
dispatched while the current one computes, so the host's work (planning, building the plan,
copying results back, detokenizing) hides behind the device's. A request whose step in flight
samples a token is planned again right away, one position further on (`_plan_ahead`); its input
token is that step's sampled token, which the runner feeds on the device (`fed_from_row`), so
nothing waits for it on the host. A request whose next step needs its result on the host first
(drafts to verify, a grammar or penalties that depend on the new token, a prompt chunk that
samples nothing) holds the next plan back until its step is in (`_holds_back`). Speculating with
n-grams, so does a request whose step in flight will likely propose drafts (`_expects_drafts`):
a step planned ahead could not verify them. A request that
the step in flight ends by length is not planned again; one that a stop token or string ends has
computed one token too many, which is dropped (its pages were freed, the step in flight writes
no page another request holds: freed pages are only reused by later steps).

Speculative decoding (engine/speculation.py): a decoding request may also verify draft tokens the
device proposed after its previous step; they extend its step (1 + k tokens, KV slots allocated
for all of them) under the same token budget. After the step only the accepted drafts count as
computed, and the pages that held nothing but rejected drafts are given back. A draft model also
writes K/V ahead while it proposes (DraftPolicy.lookahead slots): they are allocated with the
step when pages allow, and given back with the rejected drafts' (a proposal that finds no slot is
cut short on the device).
"""

from __future__ import annotations

import time
from collections import deque

from orca_jax.config import SchedulerConfig
from orca_jax.engine.kv_manager import KVCacheManager
from orca_jax.engine.request import Request, RequestStatus
from orca_jax.engine.speculation import DraftPolicy
from orca_jax.engine.step_state import ScheduledRequest, SchedulerOutput, StepsInFlight
from orca_jax.engine.step_tokens import StepTokens


class Scheduler:
    """The machinery every policy shares (queue, admission, preemption, finishing, the update
    after a step) with vLLM's behaviour (`paged`); each policy below overrides what differs."""

    # Whether results are held until the whole batch is done (the engine then emits nothing before).
    releases_whole_batches = False
    # Whether prompts are split into chunks that fill the token budget; decodes then go first.
    chunks_prompts = False
    # Whether running out of pages preempts a running request (False: reservations rule it out).
    preempts = True
    # Whether a request's pages are reserved for prompt + max_tokens at admission (not on demand).
    reserves_whole_requests = False

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, in_flight: StepsInFlight | None = None,
                 drafts: DraftPolicy | None = None, max_model_len: int = 0):
        """`in_flight`: the engine's record of its steps in flight (step_state.py; None: one step at
        a time), which also says whether this scheduler plans ahead (async scheduling)."""
        self.config = config
        self.in_flight = in_flight if in_flight is not None else StepsInFlight()
        # Requests one step takes: about 1/depth of them under a pipeline (the module docstring).
        self.max_seqs_per_step = self.in_flight.max_seqs_per_step or config.max_num_seqs
        self.kv = kv
        self.drafts = drafts  # None: no speculative decoding
        self.max_model_len = max_model_len  # tokens per request (caps the drafts)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; static: the batch, finished members included
        self.num_preemptions = 0
        self._num_decoding = 0  # requests decoding in the step being planned (_count_decoding)
        self._drafts_left = 0  # drafts the step being planned may still verify (DraftPolicy.step_drafts)

    @property
    def plans_ahead(self) -> bool:
        """Async scheduling (the module docstring): decided with the steps in flight."""
        return self.in_flight.plans_ahead

    # ---- queue ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def max_prompt_tokens(self) -> int | None:
        """The longest prompt this policy can ever admit (None: any, it splits prompts into chunks)."""
        return None if self.chunks_prompts else self.config.max_num_batched_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(not r.finished for r in self.running)

    @property
    def num_running(self) -> int:
        return sum(not r.finished for r in self.running)

    def finish(self, request: Request, status: RequestStatus) -> list[Request]:
        """Marks a request finished and returns the requests whose results can be released now:
        itself, except under `static`, where a batch is released only when all its members are done."""
        assert status.finished
        request.status = status
        request.metrics.finished_time = time.monotonic()
        if request in self.waiting:
            self.waiting.remove(request)
            return [request]
        return self._release_finished(request)

    def _release_finished(self, request: Request) -> list[Request]:
        """A finished running request leaves the batch and frees its pages."""
        self.running.remove(request)
        self.kv.free(request)
        return [request]

    # ---- planning ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._count_decoding()
        if self.plans_ahead and any(self._holds_back(r) for r in self.running):
            return out  # wait for the step in flight
        budget = self.config.max_num_batched_tokens
        for request in self._running_order():
            if request.status != RequestStatus.RUNNING or budget == 0:
                continue
            if len(out.scheduled) == self.max_seqs_per_step:
                break
            if self.in_flight.holds(request):
                if self.plans_ahead and self._plan_ahead(out, request):
                    budget -= 1
                continue
            # Without chunked prompts, only the recompute of a preempted request can exceed the budget; it
            # continues in budget-sized pieces.
            num_new = min(request.num_uncomputed_tokens, budget)
            drafts = self._drafts(request, budget - num_new)
            lookahead = self._lookahead(request)
            if (drafts or lookahead) and not self.kv.allocate(
                    request, request.num_computed_tokens + num_new + len(drafts) + lookahead):
                drafts = []  # short of pages: drafts are the first thing to go, before any preemption
            if not self._allocate_or_preempt(request, num_new, out):
                continue  # the request itself was preempted
            budget -= num_new + len(drafts)
            self._plan(out, request, num_new, drafts)
        if not out.preempted:  # admitting right after a preemption would only thrash
            self._admit(out, budget)
        return out

    def _holds_back(self, request: Request) -> bool:
        """Async scheduling: a request in flight whose next step needs that step's result on the
        host first (see the module docstring)."""
        planned = self.in_flight.newest(request)
        return planned is not None and not request.finished and (
            not planned.samples or bool(planned.draft_token_ids) or request.grammar is not None
            or request.params.uses_penalties or self._expects_drafts(request))

    def _expects_drafts(self, request: Request) -> bool:
        """Speculating, whether the step in flight of a request is likely to propose drafts it would
        verify: a step planned ahead could not verify them (its tokens are not known yet), so they are
        worth the wait. Likely after a prompt (a prompt lookup's best chance), or when the latest
        result's proposals would have been verified; a request without matches keeps planning ahead."""
        if self.drafts is None:
            return False
        planned = self.in_flight.newest(request)
        return (planned.start < len(request.prompt_token_ids)
                or self.drafts.num_drafts(request, self._drafts_left, self.max_model_len) > 0)

    def _plan_ahead(self, out: SchedulerOutput, request: Request) -> bool:
        """Async scheduling: plans a request's next decode while its step that samples the token
        before it is in flight. Not when that step ends it by length, nor when pages run short (a
        request in flight is not preempted; it waits for its step instead)."""
        planned = self.in_flight.newest(request)
        start = planned.start + planned.num_new_tokens
        num_outputs = len(request.output_token_ids) + 1  # with the token of the step in flight
        if (num_outputs >= request.params.max_tokens or start + 1 >= self.max_model_len
                or not self.kv.allocate(request, start + 1)):
            return False
        out.scheduled.append(ScheduledRequest(request, 1, start, proposes=self._proposes(), fed_from_row=planned.row))
        return True

    def _count_decoding(self) -> None:
        """Requests decoding this step (the draft policy's measure of the batch), and the drafts the
        step may verify in all."""
        self._num_decoding = sum(1 for r in self.running if r.status == RequestStatus.RUNNING
                                 and r.num_uncomputed_tokens == 1)
        self._drafts_left = 0 if self.drafts is None else self.drafts.step_drafts(self._num_decoding)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The drafts a decoding request verifies this step (none while it prefills)."""
        if self.drafts is None or request.num_uncomputed_tokens != 1:
            return []
        k = self.drafts.num_drafts(request, min(budget, self._drafts_left), self.max_model_len)
        drafts = request.draft_token_ids[:k]
        if request.grammar is not None:  # only drafts the grammar allows: no violation can be accepted
            drafts = drafts[:request.grammar.valid_prefix(drafts)]
        self._drafts_left -= len(drafts)
        return drafts

    def _lookahead(self, request: Request) -> int:
        """KV slots past the step that a decoding request's proposer writes (DraftPolicy.lookahead).
        A reservation of prompt + max_tokens already holds every slot a draft that can still be
        verified needs, so reserving policies allocate none."""
        if self.drafts is None or self.reserves_whole_requests or request.num_uncomputed_tokens != 1:
            return 0
        return self.drafts.lookahead

    def _running_order(self) -> list[Request]:
        """The running requests in the order they claim the token budget: admission order, or with
        chunked prompts decodes first, then unfinished prefills."""
        if self.chunks_prompts:
            return sorted(self.running, key=lambda r: r.num_uncomputed_tokens > 1)
        return list(self.running)

    def _reservation(self, request: Request, cached: int, num_new: int) -> int:
        """Tokens of KV pages a request must get at admission: what this step computes."""
        return cached + num_new

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        target = request.num_computed_tokens + num_new
        while not self.kv.allocate(request, target):
            if not self.preempts:
                raise AssertionError(f"{self.config.policy} reserved every page at admission; allocation cannot fail")
            victim = min((r for r in self.running if not self.in_flight.holds(r)),
                         key=lambda r: (r.num_computed_tokens, -r.metrics.arrival_time))
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        for i, planned in enumerate(out.scheduled):
            if planned.request is victim:  # already planned this step: take it back (its share of
                del out.scheduled[i]           # the token budget stays unused this step; rare and harmless)
                break
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.draft_token_ids = []
        victim.status = RequestStatus.WAITING
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        # Back to the head of the queue, in arrival order among the preempted.
        head = [r for r in self.waiting
                if r.metrics.num_preemptions > 0 and r.metrics.arrival_time < victim.metrics.arrival_time]
        self.waiting.insert(len(head), victim)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(out.scheduled) < self.max_seqs_per_step):
            request = self.waiting[0]
            cached = self.kv.match_prefix(request)
            request.num_computed_tokens = cached
            need = request.num_uncomputed_tokens
            splittable = self.chunks_prompts or request.metrics.num_preemptions > 0
            num_new = min(need, budget) if splittable else need
            if num_new > budget or not self.kv.allocate(request, self._reservation(request, cached, num_new)):
                self.kv.free(request)  # give back prefix-cache pages taken above
                request.num_computed_tokens = 0
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            metrics = request.metrics
            metrics.num_cached_prompt_tokens = max(metrics.num_cached_prompt_tokens,
                                                   min(cached, len(request.prompt_token_ids)))
            self._start_running(request)
            budget -= num_new
            self._plan(out, request, num_new)

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.monotonic()
        self.running.append(request)

    def _proposes(self) -> bool:
        """Whether the device proposes drafts after the step being planned."""
        return self.drafts is not None and self.drafts.proposes(self._num_decoding)

    def _plan(self, out: SchedulerOutput, request: Request, num_new: int, drafts: list[int] = ()) -> None:
        out.scheduled.append(ScheduledRequest(request, num_new + len(drafts), request.num_computed_tokens,
                                              list(drafts), self._proposes()))

    # ---- after the step ------------------------------------------------------------------
    def update_after_step(self, out: SchedulerOutput, sampled: dict[str, StepTokens]) -> list[Request]:
        """Advances computed-token counts, pages and drafts after a collected step (`sampled` maps
        request id -> its StepTokens for the requests whose `samples` is true). Returns the requests
        that got tokens; the engine appends them (engine._update: one at a time, as a stop among
        them drops the rest)."""
        advanced = []
        for planned in out.scheduled:
            request = planned.request
            if request.finished:
                continue  # aborted (or, planned ahead, stopped) while its step was in flight: its pages are freed
            result = sampled[request.request_id] if planned.samples else None
            # Rejected drafts' K/V are written but do not count: the next step overwrites them.
            num_rejected = len(planned.draft_token_ids) - (result.num_accepted if result else 0)
            request.num_computed_tokens = planned.start + planned.num_new_tokens - num_rejected
            if result is None:
                # Only now is their K/V written, so only now may other requests share these pages
                # (a request that sampled is registered by the engine, once its tokens are appended).
                self.kv.cache_full_pages(request, request.num_computed_tokens)
                continue
            if not self.reserves_whole_requests:  # pages that held only rejected drafts go back
                self.kv.shrink(request, request.num_tokens + len(result.tokens))  # with the new tokens
            request.draft_token_ids = result.next_drafts if planned.proposes else []
            if self.drafts is not None:
                self.drafts.record(request, len(planned.draft_token_ids), result.num_accepted)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = time.monotonic()
            advanced.append(request)
        return advanced


class PagedScheduler(Scheduler):
    """vLLM: admission while the prompt's pages fit, pages on demand, recompute preemption."""


class ChunkedScheduler(Scheduler):
    """Sarathi-Serve: decodes first, then prompt chunks fill the token budget."""

    chunks_prompts = True


class OrcaScheduler(Scheduler):
    """The Orca paper: every iteration, FCFS, while a reservation of prompt + max_tokens fits."""

    preempts = False
    reserves_whole_requests = True

    def _reservation(self, request: Request, cached: int, num_new: int) -> int:
        return request.max_total_tokens


class StaticScheduler(Scheduler):
    """Request-level batching (the FasterTransformer baseline): see the module docstring."""

    releases_whole_batches = True
    reserves_whole_requests = True

    def schedule(self) -> SchedulerOutput:
        """Request-level batching: admit a batch into an empty engine, prefill all of its prompts
        (whole prompts, as many per step as the token budget holds), then decode the whole batch
        together until its last member finishes."""
        out = SchedulerOutput()
        if any(self.in_flight.holds(r) for r in self.running):
            return out  # the batch steps as one: wait for its step in flight
        if not self.running:
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                if not self.kv.allocate(self.waiting[0], self.waiting[0].max_total_tokens):
                    break
                self._start_running(self.waiting.popleft())
        unprefilled = [r for r in self.running if r.num_computed_tokens == 0 and not r.finished]
        if unprefilled:
            budget = self.config.max_num_batched_tokens
            for request in unprefilled:
                if request.num_uncomputed_tokens > budget:
                    break
                budget -= request.num_uncomputed_tokens
                self._plan(out, request, request.num_uncomputed_tokens)
            return out
        budget = self.config.max_num_batched_tokens - len(self.running)
        self._count_decoding()
        for request in self.running:
            if request.finished:
                out.num_padding_seqs += 1
            else:
                drafts = self._drafts(request, budget)  # the reservation holds them (they stop at max_tokens)
                budget -= len(drafts)
                self._plan(out, request, request.num_uncomputed_tokens, drafts)
        return out

    def _release_finished(self, request: Request) -> list[Request]:
        """The batch keeps finished members as padding until its last member is done."""
        if any(not r.finished for r in self.running):
            return []
        released, self.running = self.running, []
        for r in released:
            self.kv.free(r)
        return released


POLICIES: dict[str, type[Scheduler]] = {
    "static": StaticScheduler,
    "orca": OrcaScheduler,
    "paged": PagedScheduler,
    "chunked": ChunkedScheduler,
}


def make_scheduler(config: SchedulerConfig, kv: KVCacheManager, in_flight: StepsInFlight | None = None,
                   drafts: DraftPolicy | None = None, max_model_len: int = 0) -> Scheduler:
    """The scheduler of the config's policy."""
    return POLICIES[config.policy](config, kv, in_flight, drafts, max_model_len)
