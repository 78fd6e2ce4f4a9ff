import pytest

from orca_jax.engine.step_plan import Buckets


@pytest.mark.parametrize("tokens, seqs", [(512, 32), (100, 12), (16, 16), (8, 2)])
def test_buckets_cover_every_step_and_never_exceed_the_limits(tokens, seqs):
    buckets = Buckets.for_limits(tokens, seqs)
    assert max(buckets.tokens) == tokens and max(buckets.seqs) == seqs
    pairs = set(buckets.pairs())
    for num_seqs in range(1, seqs + 1):
        for num_tokens in range(num_seqs, tokens + 1):
            t, s = buckets.pick(num_tokens, num_seqs)
            assert num_tokens <= t <= tokens and num_seqs <= s <= seqs
            assert (t, s) in pairs  # compiled at warm-up
    with pytest.raises(ValueError, match="exceeds the buckets"):
        buckets.pick(tokens + 1, 1)
