"""A runner without a model, for scheduler and engine tests: hand-computable outputs.

The "model" continues every sequence with (last token + 1) % vocab, so the right output of any
request is known in advance. Like the real runner it sees only StepPlans, and it checks that every
one is consistent: each row's tokens are consecutive positions ending at its KV length, each new
K/V goes to a slot of its row's own pages, no two rows write one slot, and no request is in two
dispatched steps at once (with `max_in_flight` > 1 it stands in for a pipelined runner) unless the
newer one continues it on a fed token (`feeds_sampled_tokens`: async scheduling).

Scheduling tests inspect the scheduler's decisions with `record_schedules`.
"""

import numpy as np

from orca_jax.engine.step_plan import Buckets, KVLayout, SampledToken, StepTokens


class MockRunner:
    def __init__(self, num_pages: int, page_size: int, vocab_size: int = 1000, max_in_flight: int = 1, *,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int = 4096,
                 num_speculative_tokens: int = 0, propose=None, feeds_sampled_tokens: bool = False):
        """With `num_speculative_tokens`, `propose(token)` gives the drafts proposed after a
        sequence's newest token (default: the right continuation, all accepted). With
        `feeds_sampled_tokens` it takes plans whose tokens come from the previous step's samples
        (async scheduling), as the one-stage model runner does."""
        self.buckets = Buckets.for_limits(max_num_batched_tokens, max_num_seqs)
        if num_speculative_tokens:
            self.buckets = self.buckets.with_draft_rows(num_speculative_tokens)
        self.kv_layout = KVLayout(num_pages, page_size, -(-max_model_len // page_size), self.buckets.seqs[-1],
                                  num_speculative_tokens)
        self.propose = propose or (lambda token: [(token + 1 + i) % vocab_size for i in range(num_speculative_tokens)])
        self.vocab_size = vocab_size
        self.max_in_flight = max_in_flight
        self.feeds_sampled_tokens = feeds_sampled_tokens
        self.plans = []
        self.pending: list = []  # plans dispatched and not yet collected
        self.fed_tokens = np.zeros(self.kv_layout.max_logit_rows, np.int32)  # the latest step's, per logit row
        self.num_fed_tokens = 0

    def dispatch(self, plan):
        fed = plan.token_source >= 0
        if fed.any():
            assert self.feeds_sampled_tokens, "a fed token for a runner that does not feed them"
            plan.token_ids[fed] = self.fed_tokens[plan.token_source[fed]]
            self.num_fed_tokens += int(fed.sum())
        fed_ids = {plan.request_ids[seq] for seq in plan.segment_ids[fed]}
        held = {request_id for other in self.pending for request_id in other.request_ids}
        assert not (held & set(plan.request_ids)) - fed_ids, "a request in two steps in flight, not fed"
        assert len(self.pending) < max(self.max_in_flight, 2 if self.feeds_sampled_tokens else 1)
        self._check(plan)
        self.plans.append(plan)
        self.pending.append(plan)
        sampled = {}
        for seq, first, drafts, _ in plan.sample_rows:
            tokens = []
            for i in range(len(drafts) + 1):  # the target's token at each row; stop at the first miss
                token = (int(plan.token_ids[plan.logits_index[first + i]]) + 1) % self.vocab_size
                tokens.append(SampledToken(token=token, logprob=0.0, top=None))
                if i == len(drafts) or token != drafts[i]:
                    break
            next_drafts = self.propose(tokens[-1].token) if self.kv_layout.num_speculative_tokens else []
            sampled[plan.request_ids[seq]] = StepTokens(tokens, len(drafts), next_drafts)
            self.fed_tokens[first] = tokens[0].token
        return plan, sampled

    def collect(self, pending):
        plan, sampled = pending
        assert self.pending[0] is plan, "steps are collected oldest first"
        self.pending.pop(0)
        return sampled

    def _check(self, plan) -> None:
        page_size = self.kv_layout.page_size
        real = slice(0, plan.num_real_tokens)
        slots = plan.slot_mapping[real]
        assert len(set(slots.tolist())) == len(slots), "two tokens write one KV slot"
        for row in range(len(plan.request_ids)):
            positions = plan.positions[real][plan.segment_ids[real] == row]
            assert len(positions) and (np.diff(positions) == 1).all()
            assert positions[-1] == plan.kv_lens[row] - 1, "a row's tokens end where its KV ends"
            pages = plan.block_tables[row, positions // page_size]
            row_slots = plan.slot_mapping[real][plan.segment_ids[real] == row]
            assert (row_slots == pages * page_size + positions % page_size).all(), "K/V outside the row's pages"


def record_schedules(engine) -> list:
    """Every non-empty SchedulerOutput the engine's scheduler returns from now on, in order: the
    scheduling decisions behind the plans the runner sees."""
    schedules = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        if not out.empty:
            schedules.append(out)
        return out

    engine.scheduler.schedule = recorded
    return schedules
