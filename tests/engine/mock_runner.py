"""A runner without a model, for scheduler and engine tests: hand-computable outputs.

The "model" continues every sequence with (last token + 1) % vocab, so the right output of any
request is known in advance, and it checks that every step it is given is consistent: each planned
chunk starts where the request's computed tokens end, and its KV pages cover the tokens.
"""

from orca_jax.engine.runner import SampledToken


class MockRunner:
    def __init__(self, num_pages: int, page_size: int, vocab_size: int = 1000):
        self.num_pages = num_pages
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.plans = []

    def execute(self, plan):
        self.plans.append(plan)
        sampled = {}
        for planned in plan.scheduled:
            request = planned.request
            assert planned.start == request.num_computed_tokens
            assert len(request.block_table) * self.page_size >= planned.start + planned.num_new_tokens
            if planned.samples:
                token = (request.all_token_ids[-1] + 1) % self.vocab_size
                sampled[request.request_id] = SampledToken(token=token, logprob=0.0, top=None)
        return sampled
