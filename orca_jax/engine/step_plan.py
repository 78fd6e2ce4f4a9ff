"""The engine-runner contract, without jax: the step plan, the Runner protocol (and the sampled-token
record a step returns, step_tokens.py).

A `StepPlan` is one iteration as plain numpy arrays padded to one of the runner's compiled buckets
(docs/design.md, "One iteration"): everything a device program needs, and no live `Request` objects, so
a follower process can run the leader's plan as it is (multi-host) and a mock runner can stand in
for the model. The engine builds it, once per step, from the scheduler's output:

    scheduler ──SchedulerOutput──> engine ──build_step_plan──> StepPlan ──runner.dispatch──> device
    engine    <──{request id: StepTokens}── runner.collect <── the step's one small result

Speculative decoding (docs/speculative-decoding.md): a decoding request with k draft tokens
computes 1 + k tokens, and each of them gets a logit row, so a plan has one logit row per sequence
plus one per draft: the sampler's arrays are [R] rows (R = S without drafts). A row's token is
what the target samples there; the drafts the target agrees with, in order, are accepted
(`SpeculationMetadata` tells the device which row checks which draft), and the step returns the
accepted drafts, the token after them, and the next step's drafts, proposed on the device.

The runner puts the plan on the devices as pytrees: the attention metadata with the token ids
(runner/step_inputs.py's StepInputs), the `SamplingMetadata` and, speculating, the
`SpeculationMetadata` (orca_jax/step_metadata.py: one class each, numpy here, jax arrays on the
device).

`dispatch` returns at once (jax's asynchronous dispatch); `collect` blocks on that step's result.
The engine keeps up to `runner.max_in_flight` steps dispatched (the pipeline depth), so pipeline
stages work on different iterations at once (Orca's batches in flight).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, Sequence

import numpy as np

from orca_jax.engine.request import Request
from orca_jax.engine.step_state import SchedulerOutput
from orca_jax.engine.step_tokens import SampledToken, StepTokens
from orca_jax.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_IDS
from orca_jax.step_metadata import SamplingMetadata, SpeculationMetadata

# A decode step of n sequences computes n tokens: buckets reach down to one so that a step of a few
# sequences costs about one read of the weights, not the matmuls of 16 padded rows (issue 19: on the
# Zen 3, 26 ms at 1 row against 63 at 16). Each bucket is one more compiled program (~1 s).
MIN_TOKEN_BUCKET = 1
MIN_SEQ_BUCKET = 1


def power_of_two_buckets(low: int, high: int) -> tuple[int, ...]:
    """low, 2*low, ... below high, then high itself: never a bucket above the limit."""
    buckets, size = [], low
    while size < high:
        buckets.append(size)
        size *= 2
    return tuple(buckets) + (high,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    # Logit rows (a sequence's row plus one per draft token) when speculating; () means `seqs`.
    rows: tuple[int, ...] = ()

    @property
    def row_buckets(self) -> tuple[int, ...]:
        return self.rows or self.seqs

    def with_draft_rows(self, num_speculative_tokens: int) -> "Buckets":
        """These buckets plus logit-row buckets up to every sequence with all its drafts: the
        sequence buckets, then doublings of the largest up to max_num_seqs * (1 + k)."""
        largest = self.seqs[-1] * (1 + num_speculative_tokens)
        more = tuple(b for b in power_of_two_buckets(self.seqs[-1], largest) if b > self.seqs[-1])
        return dataclasses.replace(self, rows=self.seqs + more)

    def pick_rows(self, num_rows: int) -> int:
        r = next((b for b in self.row_buckets if b >= num_rows), None)
        if r is None:
            raise ValueError(f"step of {num_rows} logit rows exceeds the buckets {self}")
        return r

    @classmethod
    def for_limits(cls, max_num_batched_tokens: int, max_num_seqs: int) -> "Buckets":
        """Powers of two from one up to the limits."""
        return cls(
            tokens=power_of_two_buckets(min(MIN_TOKEN_BUCKET, max_num_batched_tokens), max_num_batched_tokens),
            seqs=power_of_two_buckets(min(MIN_SEQ_BUCKET, max_num_seqs), max_num_seqs),
        )

    def pairs(self) -> list[tuple[int, int]]:
        """Every (tokens, seqs) shape a step can take: a sequence has at least one token."""
        return [(t, s) for t in self.tokens for s in self.seqs if s <= t]

    def pick(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        t = next((b for b in self.tokens if b >= num_tokens), None)
        s = next((b for b in self.seqs if b >= num_seqs), None)
        if t is None or s is None:
            raise ValueError(f"step of {num_tokens} tokens / {num_seqs} seqs exceeds the buckets {self}")
        return t, s


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What a plan needs to know of the KV cache: where pages are and where padding writes."""

    num_pages: int
    page_size: int
    max_pages_per_seq: int
    # Rows of every step's block tables, KV lengths and last-token indices (the largest sequence
    # bucket): the same in every step, so the layers' programs depend on the token bucket only.
    max_num_seqs: int
    num_speculative_tokens: int = 0  # draft tokens a sequence may verify per step (0: no speculation)

    @property
    def max_logit_rows(self) -> int:
        """Logit rows of every step's layers program: every sequence with all its drafts."""
        return self.max_num_seqs * (1 + self.num_speculative_tokens)

    @property
    def scratch_slot(self) -> int:
        """The slot padding tokens write to: the extra page at index num_pages, owned by nobody."""
        return self.num_pages * self.page_size


@dataclasses.dataclass
class StepPlan:
    """One step's device inputs, padded to the bucket (T tokens, S sequences). Picklable."""

    token_ids: np.ndarray  # [T] int32
    # [T] int32: -1, or the logit row of the previous step whose sampled token this token is (async
    # scheduling: the runner feeds it on the device; token_ids holds 0 there)
    token_source: np.ndarray
    positions: np.ndarray  # [T] int32
    segment_ids: np.ndarray  # [T] row of the token's sequence; padding: S_max (out of range)
    slot_mapping: np.ndarray  # [T] cache slot each new K/V goes to; padding: the scratch slot
    block_tables: np.ndarray  # [S_max, max_pages] int32 (S_max = KVLayout.max_num_seqs)
    kv_lens: np.ndarray  # [S_max] cached tokens per sequence after this step
    logits_index: np.ndarray  # [R_max] the token of each logit row (R_max = KVLayout.max_logit_rows)
    sampling: SamplingMetadata  # [R] rows: without drafts one per sequence, so R = S
    speculation: SpeculationMetadata | None = None  # a speculating runner's plans only (block_tables None)
    # Leader only: the request of every sequence row, and (sequence row, its first logit row, the
    # drafts it verifies, top logprobs asked or None) for every sequence that samples a token.
    request_ids: list[str] = dataclasses.field(default_factory=list)
    sample_rows: list[tuple[int, int, list[int], int | None]] = dataclasses.field(default_factory=list)
    num_real_tokens: int = 0  # tokens before padding
    num_padding_seqs: int = 0  # static policy: finished members that still take a row (and a token)

    @property
    def bucket(self) -> tuple[int, int]:
        return len(self.token_ids), len(self.sampling.temperature)


class RunnerLost(RuntimeError):
    """The runner can run no more steps: a follower process died or stalled (multi-host). Unlike a
    failed step, nothing can go on: every request in flight fails with it and the process exits."""


class Runner(Protocol):
    """What the engine needs of a runner (the model runner, or a mock in scheduler tests)."""

    kv_layout: KVLayout  # the KV pages the plans address
    buckets: Buckets  # the shapes a plan may take
    max_in_flight: int  # steps the engine may keep dispatched at once (the pipeline depth)
    # Whether a plan's `token_source` works: a step's tokens may be the previous step's sampled ones,
    # taken on the device (what async scheduling needs)
    feeds_sampled_tokens: bool

    def dispatch(self, plan: StepPlan) -> Any:
        """Starts the step without waiting for it; returns a handle for `collect`."""

    def collect(self, pending: Any) -> dict[str, StepTokens]:
        """Waits for a dispatched step; the new tokens of every request whose step reached its end."""

    def run_first_runs(self, limit: int | None = None) -> int:
        """Runs up to `limit` (None: all) of the programs that have not run yet, on padding steps
        (a program's first run is slow); returns how many such padding steps remain."""


class SampleRow(NamedTuple):
    """A logit row's request, and what comes before the token it samples: the drafts verified
    before it, and (async scheduling) the tokens sampled by the request's step in flight, not known
    here yet. It samples the request's output token number len(outputs) + ahead + len(drafts)."""

    request: Request
    drafts_before: list[int]
    ahead: int = 0

    @property
    def token_index(self) -> int:
        return len(self.request.output_token_ids) + self.ahead + len(self.drafts_before)


def padding_plan(num_tokens: int, num_rows: int, kv: KVLayout, vocab_size: int,
                 rows: Sequence[SampleRow] = ()) -> StepPlan:
    """A plan of one bucket's shape (T tokens, R logit rows), all padding (tokens out of every
    segment, writing only to the scratch slot), with the sampling parameters of `rows` in its first
    rows. Warm-up runs it as it is; `build_step_plan` fills in the real rows."""
    return StepPlan(
        token_ids=np.zeros(num_tokens, np.int32),
        token_source=np.full(num_tokens, -1, np.int32),
        positions=np.zeros(num_tokens, np.int32),
        segment_ids=np.full(num_tokens, kv.max_num_seqs, np.int32),
        slot_mapping=np.full(num_tokens, kv.scratch_slot, np.int32),
        block_tables=np.zeros((kv.max_num_seqs, kv.max_pages_per_seq), np.int32),
        kv_lens=np.zeros(kv.max_num_seqs, np.int32),
        logits_index=np.zeros(kv.max_logit_rows, np.int32),
        sampling=sampling_arrays(list(rows), num_rows, vocab_size),
        speculation=SpeculationMetadata.empty(num_rows, kv.max_num_seqs) if kv.num_speculative_tokens else None,
    )


def build_step_plan(out: SchedulerOutput, buckets: Buckets, kv: KVLayout, vocab_size: int) -> StepPlan:
    # Static batches keep finished members as padding rows: they cost compute, as in FasterTransformer.
    num_tokens, _ = buckets.pick(out.num_batched_tokens + out.num_padding_seqs, out.num_seqs)
    num_rows = buckets.pick_rows(out.num_seqs + out.num_draft_tokens)
    rows = [SampleRow(p.request, p.draft_token_ids[:i], int(p.fed_from_row >= 0))
            for p in out.scheduled for i in range(1 + len(p.draft_token_ids))]
    plan = padding_plan(num_tokens, num_rows, kv, vocab_size, rows)
    spec = plan.speculation
    page_size = kv.page_size
    t = r = 0
    for seq, planned in enumerate(out.scheduled):
        request, n, start, drafts = planned.request, planned.num_new_tokens, planned.start, planned.draft_token_ids
        k = len(drafts)
        plan.request_ids.append(request.request_id)
        table = request.block_table
        plan.block_tables[seq, :len(table)] = table
        plan.kv_lens[seq] = start + n
        if planned.fed_from_row >= 0:  # its one token is still on the device
            plan.token_source[t] = planned.fed_from_row
        else:
            plan.token_ids[t:t + n - k] = request.token_ids_between(start, start + n - k)
        if k:
            plan.token_ids[t + n - k:t + n] = drafts
        plan.segment_ids[t:t + n] = seq
        if n == 1:  # a decode without drafts (most rows of most steps): scalars, no small arrays
            plan.positions[t] = start
            plan.slot_mapping[t] = table[start // page_size] * page_size + start % page_size
            plan.logits_index[r] = t
        else:
            pos = np.arange(start, start + n, dtype=np.int32)
            plan.positions[t:t + n] = pos
            plan.slot_mapping[t:t + n] = np.asarray(table, np.int32)[pos // page_size] * page_size + pos % page_size
            # The sequence's logit rows: its last real token, then each draft (row i checks draft i).
            plan.logits_index[r:r + 1 + k] = np.arange(t + n - 1 - k, t + n, dtype=np.int32)
        if spec is not None:
            spec.row_draft[r:r + k] = drafts
            spec.row_first[r:r + 1 + k] = r
            spec.row_seq[r:r + 1 + k] = seq
            spec.seq_first_row[seq] = r
            spec.seq_history_len[seq] = start + n - k
            spec.seq_proposes[seq] = planned.samples and planned.proposes
            spec.seq_num_slots[seq] = len(table) * kv.page_size
        planned.row = r
        if planned.samples:
            plan.sample_rows.append((seq, r, drafts, request.params.logprobs))
        t += n
        r += 1 + k
    if spec is not None:
        spec.any_proposes = np.bool_(spec.seq_proposes.any())
    plan.num_real_tokens = out.num_batched_tokens
    plan.num_padding_seqs = out.num_padding_seqs
    return plan


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a step's token bitmask (bit v % 32 of word v // 32: token v allowed)."""
    return -(-vocab_size // 32)


def sampling_arrays(rows: list[SampleRow], num_rows: int, vocab_size: int) -> SamplingMetadata:
    """Per-row sampling parameters as [R] arrays, so no combination of parameters recompiles. A
    row samples its request's output token number `SampleRow.token_index`, as if the drafts before
    it were already outputs. (A grammar or penalties never meet a row with tokens ahead: the
    scheduler does not plan such requests ahead.)"""
    requests = [row.request for row in rows]
    params = [r.params for r in requests]

    def column(values: list, dtype, fill):
        array = np.full(num_rows, fill, dtype)
        array[:len(values)] = values
        return array

    stop_ids = np.full((num_rows, MAX_STOP_IDS), -1, np.int32)
    suppress = np.zeros(num_rows, bool)
    for row, sample_row in enumerate(rows):
        r = sample_row.request
        if sample_row.token_index < r.params.min_tokens:
            ids = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else r.eos_token_ids)
            stop_ids[row, :len(ids)] = sorted(ids)
            suppress[row] = True
    # Every step ships the bias arrays (small, fixed shapes): rows without one have zero bias, and
    # the sampler skips the work when no row has one. The token bitmask only when a row has a
    # grammar (rows without one all ones): at V / 32 words a row (16 KB for a 128k vocabulary) it
    # was most of a step's host arrays; otherwise the runner passes all-ones words it keeps on the
    # device, as it does the penalties' zeros.
    use_bitmask = any(r.grammar is not None for r in requests)
    bitmask = np.full((num_rows, bitmask_width(vocab_size)), -1, np.int32) if use_bitmask else None
    bias_ids = np.zeros((num_rows, MAX_LOGIT_BIAS), np.int32)
    bias_values = np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32)
    for row, (r, before, _) in enumerate(rows):
        if r.grammar is not None:  # drafts are a prefix the grammar allows (the scheduler checked)
            r.grammar.fill_bitmask_after(bitmask[row], before)
        if r.params.logit_bias:
            bias_ids[row, :len(r.params.logit_bias)] = list(r.params.logit_bias)
            bias_values[row, :len(r.params.logit_bias)] = list(r.params.logit_bias.values())
    use_penalties = any(r.params.uses_penalties for r in requests)
    counts = seen = None
    if use_penalties:
        counts = np.zeros((num_rows, vocab_size), np.int32)
        seen = np.zeros((num_rows, vocab_size), bool)
        for row, (r, before, _) in enumerate(rows):
            if r.params.uses_penalties:
                counts[row] = np.bincount(r.output_token_ids + before, minlength=vocab_size)
                seen[row, r.prompt_token_ids] = True
                seen[row] |= counts[row] > 0
    return SamplingMetadata(
        temperature=column([p.temperature for p in params], np.float32, 0.0),
        top_k=column([p.top_k for p in params], np.int32, 0),
        top_p=column([p.top_p for p in params], np.float32, 1.0),
        min_p=column([p.min_p for p in params], np.float32, 0.0),
        repetition_penalty=column([p.repetition_penalty for p in params], np.float32, 1.0),
        presence_penalty=column([p.presence_penalty for p in params], np.float32, 0.0),
        frequency_penalty=column([p.frequency_penalty for p in params], np.float32, 0.0),
        seeds=column([(r.seed ^ (r.seed >> 32)) & 0xFFFFFFFF for r in requests], np.uint32, 0),
        token_index=np.array([row.token_index for row in rows] + [0] * (num_rows - len(rows)), np.int32),
        stop_ids=stop_ids,
        suppress_stop=suppress,
        output_counts=counts,
        seen_tokens=seen,
        use_penalties=np.bool_(use_penalties),
        token_bitmask=bitmask,
        use_bitmask=np.bool_(use_bitmask),
        bias_ids=bias_ids,
        bias_values=bias_values,
        use_logit_bias=np.bool_(any(r.params.logit_bias for r in requests)),
        need_logprobs=np.bool_(any(r.params.logprobs is not None for r in requests)),
        num_real_rows=np.int32(len(rows)),
    )


def step_tokens(plan: StepPlan, tokens, logprob, top_ids, top_logprobs, accepted=None, drafts=None,
                num_drafts=None) -> dict[str, StepTokens]:
    """The step's host result back to the requests that asked for tokens: [R] per logit row
    (`accepted`: the row's draft was accepted; None without speculation), [S_max] per sequence
    (`drafts` [S_max, k] proposed for the next step, `num_drafts` of them valid)."""
    # Python lists first: indexing a numpy array per row made a numpy scalar per value, each converted again.
    tokens, logprob = np.asarray(tokens).tolist(), np.asarray(logprob).tolist()

    def token(row: int, num_top: int | None, value: int | None = None) -> SampledToken:
        top = None if num_top is None else (top_ids[row, :num_top].tolist(), top_logprobs[row, :num_top].tolist())
        return SampledToken(token=tokens[row] if value is None else value, logprob=logprob[row], top=top)

    result = {}
    for seq, first, verified, num_top in plan.sample_rows:
        num_accepted = 0
        while num_accepted < len(verified) and accepted[first + num_accepted]:
            num_accepted += 1
        # The accepted drafts (the rows that drew them), then the first row's token that was not one.
        new = [token(first + i, num_top, verified[i]) for i in range(num_accepted)]
        new.append(token(first + num_accepted, num_top))
        proposed = [] if drafts is None else drafts[seq, :num_drafts[seq]].tolist()
        result[plan.request_ids[seq]] = StepTokens(new, len(verified), proposed)
    return result
