"""A runner without a model, for scheduler and engine tests: hand-computable outputs.

The "model" continues every sequence with (last token + 1) % vocab, so the right output of any
request is known in advance, and it checks that every step it is given is consistent: each planned
chunk starts where the request's computed tokens end, its KV pages cover the tokens, and no request
is in two dispatched steps at once (with `max_in_flight` > 1 it stands in for a pipelined runner).
"""

from orca_jax.engine.step_plan import SampledToken


class MockRunner:
    def __init__(self, num_pages: int, page_size: int, vocab_size: int = 1000, max_in_flight: int = 1):
        self.num_pages = num_pages
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.max_in_flight = max_in_flight
        self.plans = []
        self.pending: list = []  # plans dispatched and not yet collected

    def dispatch(self, plan):
        held = {p.request.request_id for other in self.pending for p in other.scheduled}
        assert not held & {p.request.request_id for p in plan.scheduled}, "a request in two steps in flight"
        assert len(self.pending) < self.max_in_flight
        self.plans.append(plan)
        self.pending.append(plan)
        sampled = {}
        for planned in plan.scheduled:
            request = planned.request
            assert planned.start == request.num_computed_tokens
            assert len(request.block_table) * self.page_size >= planned.start + planned.num_new_tokens
            if planned.samples:
                token = (request.all_token_ids[-1] + 1) % self.vocab_size
                sampled[request.request_id] = SampledToken(token=token, logprob=0.0, top=None)
        return plan, sampled

    def collect(self, pending):
        plan, sampled = pending
        assert self.pending[0] is plan, "steps are collected oldest first"
        self.pending.pop(0)
        return sampled
