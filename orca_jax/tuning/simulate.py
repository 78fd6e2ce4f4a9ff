"""A step-by-step simulation of the scheduling policies, written from their rules (docs/design.md,
"The policies", and orca_jax/engine/scheduler.py), on request lengths alone. Pure Python: no jax, no
engine import.

It predicts, for a workload of (prompt_len, max_tokens) requests that each generate exactly
max_tokens tokens (ignore_eos), the engine's iterations and the composition of every one (tokens,
sequences, static's padding rows). With every request queued at once (`simulate`) the tests hold
it to the real engine's `num_steps`, step by step. Its scope:

- prefix caching is not modelled (hits depend on token content, not lengths): simulate engines that
  run with it off, or workloads whose prompts share no full page;
- the KV cache is modelled as a count of free pages: without prefix caching, which page a request
  gets never changes a decision, only how many are free (so preemption under KV pressure is exact);
- ties between preemption victims with equal computed tokens go to the latest arrival, as in the
  engine when requests are added one after another.

- `async_scheduling` (the engine's default, with one stage): the engine plans step n + 1 while step
  n is in flight, from what it knew before step n's tokens came back (scheduler.py, "Async
  scheduling"): requests in step n that sample decode again at once, one position on; pages and
  slots a request finishing in step n frees, and requests that arrived during step n - 1, are seen a
  step later; a request whose prompt chunk in flight samples nothing holds the plan back until the
  step is in. A new request's first chunk thus comes a step later: near capacity, on a virtual
  clock with the tuning workload, the TTFT p99 changed by 1-12% (mostly longer). Without it the
  engine steps one iteration at a time.

Combined with a measured step-time model (seconds per step as a function of its padded shape), the
simulated steps give a predicted wall time per policy, hence the throughput ratio the benchmark
should reach; `ideal_ratio` gives the iteration-count ratio from the workload alone.

`simulate_arrivals` adds time: requests arrive at given offsets (they join the queue at the first
iteration planned after they arrived), every step takes what a step-cost function says, and each
request's first token and last token are stamped with the clock at the end of the step that
sampled them (static releases a batch's tokens when the whole batch is done, as the engine does):
hence each request's time to first token (TTFT) and time per output token (TPOT).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable

POLICIES = ("static", "orca", "paged", "chunked")


@dataclass(frozen=True)
class SimConfig:
    policy: str
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    num_pages: int
    async_scheduling: bool = False  # the engine plans each step while the one before computes

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}; choose one of {POLICIES}")


@dataclass
class SimStep:
    chunks: tuple[tuple[int, int], ...]  # (start, num_new) of each scheduled sequence, in the plan's order
    num_padding_seqs: int = 0  # static: finished members still occupying a batch row
    end_s: float = 0.0  # simulate_arrivals: the clock when the step's tokens are out

    @property
    def num_tokens(self) -> int:
        """Tokens computed: prefill chunks plus one per decode."""
        return sum(n for _, n in self.chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    @property
    def padded_num_tokens(self) -> int:
        """Tokens the runner lays out before bucket padding: static's padding rows carry one each."""
        return self.num_tokens + self.num_padding_seqs

    @property
    def padded_num_seqs(self) -> int:
        return self.num_seqs + self.num_padding_seqs


@dataclass
class SimResult:
    config: SimConfig
    steps: list[SimStep]
    num_preemptions: int
    requests: list = field(default_factory=list)  # _Req, in arrival order, with their times
    kv_bound: bool = False  # whether KV pages ever ran short (more of them would change the run)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def ttft_s(self) -> list[float]:
        """Each request's time to first token: from its arrival to the release of its first token."""
        return [r.first_token_s - r.arrival_s for r in self.requests]

    def tpot_s(self) -> list[float]:
        """Each request's time per output token after the first (requests of one token have none)."""
        return [(r.finish_s - r.first_token_s) / (r.max_tokens - 1) for r in self.requests if r.max_tokens > 1]

    @property
    def end_s(self) -> float:
        return max((r.finish_s for r in self.requests), default=0.0)


@dataclass(eq=False)  # identity semantics: requests are found in lists with `is` / `remove`
class _Req:
    index: int  # arrival order
    prompt_len: int
    max_tokens: int
    generated: int = 0
    computed: int = 0  # tokens whose K/V are in the cache
    pages: int = 0
    preemptions: int = 0
    running: bool = False
    finished: bool = False
    in_flight: tuple | None = None  # its entry in the newest step in flight: (step, start, num_new, samples)
    arrival_s: float = 0.0
    scheduled_s: float | None = None  # when the step that first scheduled it began
    first_token_s: float = 0.0  # when its first token was released
    finish_s: float = 0.0  # when its last token was released

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def uncomputed(self) -> int:
        return self.num_tokens - self.computed


class _Simulator:
    def __init__(self, lengths: list[tuple[int, int]], config: SimConfig, arrivals: list[float] | None = None):
        self.config = config
        requests = [_Req(i, p, o) for i, (p, o) in enumerate(lengths)]
        for r, arrival in zip(requests, arrivals or ()):
            r.arrival_s = arrival
        self.requests = list(requests)
        self.arriving = requests[::-1] if arrivals else []  # not yet arrived, the next one last
        self.waiting = [] if arrivals else requests
        self.running: list[_Req] = []
        self.free_pages = config.num_pages
        self.num_preemptions = 0
        self.kv_bound = False  # whether a page request was ever refused (more pages would change the run)
        self.steps: list[SimStep] = []
        self.clock = 0.0  # the host's: when the engine plans, adds arrivals and releases tokens
        self.pending: list[tuple[int, list]] = []  # steps in flight: (index, plan), oldest first
        self.device_free = 0.0  # when the step last dispatched ends

    # ---- KV pages (counts only) -------------------------------------------------------------
    def allocate(self, r: _Req, num_tokens: int) -> bool:
        need = max(0, -(-num_tokens // self.config.page_size) - r.pages)
        if need > self.free_pages:
            self.kv_bound = True
            return False
        self.free_pages -= need
        r.pages += need
        return True

    def free(self, r: _Req) -> None:
        self.free_pages += r.pages
        r.pages = 0

    # ---- one iteration: a plan of (request, start, num_new): num_new tokens after `start` ones ---
    def schedule(self) -> tuple[list[tuple[_Req, int, int]], int]:
        if self.config.policy == "static":
            return self.schedule_static()
        plan: list[tuple[_Req, int, int]] = []
        if any(r.in_flight and not r.in_flight[3] for r in self.running):
            return plan, 0  # a prompt chunk in flight samples nothing: wait for it
        budget = self.config.max_num_batched_tokens
        running = list(self.running)
        if self.config.policy == "chunked":  # decodes first, then unfinished prefill chunks
            running.sort(key=lambda r: r.uncomputed > 1)
        preempted = False
        for r in running:
            if not r.running or budget == 0:
                continue
            if r.in_flight:  # planned ahead: its next decode, unless its step in flight ends it
                start = r.in_flight[1] + r.in_flight[2]
                if r.generated + 1 < r.max_tokens and self.allocate(r, start + 1):
                    budget -= 1
                    plan.append((r, start, 1))
                continue
            num_new = min(r.uncomputed, budget)
            scheduled = True
            while not self.allocate(r, r.computed + num_new):
                assert self.config.policy != "orca", "orca reserves every page at admission"
                victim = min((v for v in self.running if not v.in_flight), key=lambda v: (v.computed, -v.index))
                plan = [e for e in plan if e[0] is not victim]  # its budget share stays spent
                self.preempt(victim)
                preempted = True
                if victim is r:
                    scheduled = False
                    break
            if scheduled:
                budget -= num_new
                plan.append((r, r.computed, num_new))
        if not preempted:
            self.admit(plan, budget)
        return plan, 0

    def preempt(self, victim: _Req) -> None:
        self.running.remove(victim)
        self.free(victim)
        victim.computed = 0
        victim.running = False
        victim.preemptions += 1
        self.num_preemptions += 1
        # Head of the queue, after earlier-arriving preempted requests already there.
        position = sum(1 for w in self.waiting if w.preemptions > 0 and w.index < victim.index)
        self.waiting.insert(position, victim)

    def admit(self, plan: list[tuple[_Req, int, int]], budget: int) -> None:
        policy = self.config.policy
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            r = self.waiting[0]
            splittable = policy == "chunked" or r.preemptions > 0
            num_new = min(r.uncomputed, budget) if splittable else r.uncomputed
            reserve = r.prompt_len + r.max_tokens if policy == "orca" else num_new
            if num_new > budget or not self.allocate(r, reserve):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.pop(0)
            r.running = True
            self.running.append(r)
            budget -= num_new
            plan.append((r, r.computed, num_new))

    def schedule_static(self) -> tuple[list[tuple[_Req, int, int]], int]:
        if any(r.in_flight for r in self.running):
            return [], 0  # the batch steps as one: wait for its step in flight
        if not self.running:  # admit a batch, reserving prompt + max_tokens for each member
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                r = self.waiting[0]
                if not self.allocate(r, r.prompt_len + r.max_tokens):
                    break
                self.waiting.pop(0)
                r.running = True
                self.running.append(r)
        unprefilled = [r for r in self.running if r.computed == 0 and not r.finished]
        if unprefilled:  # whole prompts, as many per step as the token budget holds
            plan, budget = [], self.config.max_num_batched_tokens
            for r in unprefilled:
                if r.uncomputed > budget:
                    break
                budget -= r.uncomputed
                plan.append((r, r.computed, r.uncomputed))
            return plan, 0
        plan = [(r, r.computed, r.uncomputed) for r in self.running if not r.finished]
        return plan, len(self.running) - len(plan)

    # ---- after the step ----------------------------------------------------------------------
    def run(self, step_seconds: Callable[[SimStep], float] | None = None) -> SimResult:
        """The engine's loop (engine.py, `_step`): plan and dispatch while there is room in flight
        (one step, or two planning ahead), else collect the oldest step."""
        depth = 2 if self.config.async_scheduling else 1
        while self.arriving or self.waiting or self.running or self.pending:
            while self.arriving and self.arriving[-1].arrival_s <= self.clock:
                self.waiting.append(self.arriving.pop())  # arrival order is index order
            if not (self.waiting or self.running or self.pending):
                self.clock = self.arriving[-1].arrival_s  # idle until the next arrival
                continue
            plan = []
            if len(self.pending) < depth:
                plan, padding = self.schedule()  # empty: nothing to run, or it only preempted
                if plan:
                    self.dispatch(plan, padding, step_seconds)
            if self.pending and not (plan and len(self.pending) < depth):
                self.collect(*self.pending.pop(0))
            assert len(self.steps) < 1_000_000, "the simulation does not terminate"
        return SimResult(self.config, self.steps, self.num_preemptions, self.requests, self.kv_bound)

    def dispatch(self, plan: list[tuple[_Req, int, int]], padding: int, step_seconds) -> None:
        """The step runs once the device is free (after the step in flight) and the host is here."""
        step = SimStep(tuple((start, n) for _, start, n in plan), padding)
        began = max(self.clock, self.device_free)
        self.device_free = step.end_s = began + (step_seconds(step) if step_seconds is not None else 0.0)
        index = len(self.steps)
        self.steps.append(step)
        for r, start, n in plan:
            r.scheduled_s = began if r.scheduled_s is None else r.scheduled_s
            # It samples if it ends at its last token (a step planned ahead always does).
            r.in_flight = (index, start, n, r.in_flight is not None or start + n == r.num_tokens)
        self.pending.append((index, plan))

    def collect(self, index: int, plan: list[tuple[_Req, int, int]]) -> None:
        """The step's tokens are in: the host's clock is at its end, and its requests advance."""
        self.clock = max(self.clock, self.steps[index].end_s)
        for r, start, num_new in plan:
            if r.in_flight and r.in_flight[0] == index:
                r.in_flight = None  # no newer step holds it
            samples = start + num_new == r.num_tokens  # the steps before it are in: its tokens are known
            r.computed = start + num_new
            if samples:
                r.generated += 1
                if r.generated == 1:
                    r.first_token_s = self.clock
                if r.generated == r.max_tokens:
                    self.finish(r)

    def finish(self, r: _Req) -> None:
        r.finished = True
        r.finish_s = self.clock
        if self.config.policy == "static":
            if all(m.finished for m in self.running):  # the batch is released as a whole
                for m in self.running:
                    self.free(m)
                    m.first_token_s = m.finish_s = self.clock  # its tokens reach the client only now
                self.running = []
            return
        self.running.remove(r)
        self.free(r)


def simulate(lengths: list[tuple[int, int]], config: SimConfig) -> SimResult:
    """Steps of the engine under `config` for requests of (prompt_len, max_tokens), all queued at
    once in this order. Raises ValueError for a request the engine would reject."""
    check_requests(lengths, config)
    return _Simulator(lengths, config).run()


def simulate_arrivals(lengths: list[tuple[int, int]], arrivals: list[float], config: SimConfig,
                      step_seconds: Callable[[SimStep], float]) -> SimResult:
    """The engine under `config` for requests of (prompt_len, max_tokens) arriving at `arrivals`
    (seconds, non-decreasing), each step taking `step_seconds(step)`; the result's requests carry
    their times (SimResult.ttft_s, tpot_s). Raises ValueError for a request the engine would reject."""
    if len(arrivals) != len(lengths) or any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError("need one arrival time per request, in non-decreasing order")
    check_requests(lengths, config)
    return _Simulator(lengths, config, list(arrivals)).run(step_seconds)


def check_requests(lengths: list[tuple[int, int]], config: SimConfig) -> None:
    """Raises ValueError for a request the engine would reject under `config`."""
    capacity = config.num_pages * config.page_size
    for i, (prompt_len, max_tokens) in enumerate(lengths):
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError(f"request {i}: need prompt_len >= 1 and max_tokens >= 1")
        if prompt_len + max_tokens > capacity:
            raise ValueError(f"request {i}: {prompt_len + max_tokens} tokens exceed the KV cache ({capacity})")
        if config.policy != "chunked" and prompt_len > config.max_num_batched_tokens:
            raise ValueError(f"request {i}: prompt of {prompt_len} tokens exceeds the token budget")


def ideal_ratio(lengths: list[tuple[int, int]], max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    """Iterations of request-level (static) vs iteration-level (orca) scheduling at the same batch
    size, with a KV cache large enough never to bind: the gain that comes from the workload alone."""
    page_size = 16
    pages = sum(-(-(p + o) // page_size) for p, o in lengths)
    static = simulate(lengths, SimConfig("static", max_num_seqs, max_num_batched_tokens, page_size, pages))
    orca = simulate(lengths, SimConfig("orca", max_num_seqs, max_num_batched_tokens, page_size, pages))
    return {"static_steps": static.num_steps, "orca_steps": orca.num_steps,
            "step_ratio": static.num_steps / orca.num_steps}


# ---- step-time model and predicted wall time -------------------------------------------------

@dataclass
class StepTimeModel:
    """Seconds per step, from measurements of the runner on this machine.

    A step of T tokens and S sequences runs the compiled shape (T_bucket, S_bucket), the smallest
    buckets holding it, so it costs that shape's `base` (measured with nothing cached), plus the
    attention over cached context. The XLA attention reads context in blocks of `block_tokens`, in
    two row groups -- the first S_bucket token rows (decodes come first) and the rest -- each
    looping as far as the longest context among its tokens; each block costs every row of the group:
        seconds = base[(T_bucket, S_bucket)]
                  + s_per_row_block * (rows_1 * blocks(ctx_1) + rows_2 * blocks(ctx_2))
    where a token's context is what its sequence had cached before the step."""

    token_buckets: list[int]
    seq_buckets: list[int]
    base: dict[tuple[int, int], float]
    block_tokens: int
    s_per_row_block: float = 0.0

    def bucket(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        t = self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]
        s = self.seq_buckets[bisect.bisect_left(self.seq_buckets, num_seqs)]
        return t, s

    def step_seconds(self, step: SimStep) -> float:
        t, s = self.bucket(step.padded_num_tokens, step.padded_num_seqs)
        split = min(s, t)
        context = [0, 0]  # longest context among the tokens of each row group
        position = 0
        for start, n in step.chunks:
            if position < split:
                context[0] = max(context[0], start)
            if position + n > split:
                context[1] = max(context[1], start)
            position += n
        if split == t:
            context = [max(context), 0]
        blocks = [-(-c // self.block_tokens) for c in context]
        return self.base[(t, s)] + self.s_per_row_block * (split * blocks[0] + (t - split) * blocks[1])

    def to_json(self) -> dict:
        return {"token_buckets": self.token_buckets, "seq_buckets": self.seq_buckets,
                "base_ms": {f"{t}x{s}": 1000 * v for (t, s), v in sorted(self.base.items())},
                "block_tokens": self.block_tokens, "us_per_row_block": 1e6 * self.s_per_row_block}


def predicted_wall_s(result: SimResult, model: StepTimeModel) -> float:
    return sum(model.step_seconds(step) for step in result.steps)


def occupancy(result: SimResult) -> dict:
    """Mean real sequences per step and static's padding rows (decode slots spent on finished members)."""
    steps = result.steps
    return {"mean_seqs_per_step": sum(s.num_seqs for s in steps) / len(steps),
            "mean_tokens_per_step": sum(s.num_tokens for s in steps) / len(steps),
            "padding_seq_slots": sum(s.num_padding_seqs for s in steps)}
