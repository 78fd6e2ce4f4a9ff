"""The on-device sampler on hand-made logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.model.sampler import SamplingMetadata, filter_logits, first_argmax, processed_logits, sample

V = 8


def metadata(rows, **overrides):
    base = dict(
        temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32), repetition_penalty=np.ones(rows, np.float32),
        presence_penalty=np.zeros(rows, np.float32), frequency_penalty=np.zeros(rows, np.float32),
        seeds=np.arange(rows, dtype=np.uint32), token_index=np.zeros(rows, np.int32),
        stop_ids=np.full((rows, 4), -1, np.int32), suppress_stop=np.zeros(rows, bool),
        output_counts=np.zeros((rows, V), np.int32), seen_tokens=np.zeros((rows, V), bool),
        use_penalties=np.bool_(False), need_logprobs=np.bool_(False),
        token_bitmask=np.full((rows, 1), -1, np.int32), use_bitmask=np.bool_(False),
        bias_ids=np.zeros((rows, 3), np.int32), bias_values=np.zeros((rows, 3), np.float32),
        use_logit_bias=np.bool_(False),
    )
    base.update(overrides)
    return SamplingMetadata(**{k: jnp.asarray(v) for k, v in base.items()})


LOGITS = jnp.asarray([[0.0, 1.0, 3.0, 2.9, 0.5, -1.0, 0.0, 0.0]])


def test_greedy_and_penalties():
    assert int(sample(LOGITS, metadata(1)).tokens[0]) == 2
    counts = np.zeros((1, V), np.int32)
    counts[0, 2] = 1
    penalised = metadata(1, output_counts=counts, seen_tokens=counts > 0, presence_penalty=np.float32([0.5]),
                         use_penalties=np.bool_(True))
    assert int(sample(LOGITS, penalised).tokens[0]) == 3  # 3.0 - 0.5 < 2.9
    repeated = metadata(1, seen_tokens=counts > 0, repetition_penalty=np.float32([1.1]), use_penalties=np.bool_(True))
    assert int(sample(LOGITS, repeated).tokens[0]) == 3  # 3.0 / 1.1 < 2.9
    # The flag gates the work: with it off, the same arrays change nothing.
    assert int(sample(LOGITS, metadata(1, output_counts=counts, presence_penalty=np.float32([0.5]))).tokens[0]) == 2


def test_min_tokens_suppresses_stop_tokens():
    stop = np.full((1, 4), -1, np.int32)
    stop[0, 0] = 2
    out = sample(LOGITS, metadata(1, stop_ids=stop, suppress_stop=np.array([True])))
    assert int(out.tokens[0]) == 3


def test_stop_suppression_touches_only_its_rows_ids():
    """Row 0 (suppressing) loses exactly its stop ids, the last vocabulary entry among them; row 1 (not
    suppressing) keeps its own; a -1 padding id suppresses nothing (not the last entry either)."""
    logits = jnp.tile(LOGITS, (3, 1))
    stop = np.full((3, 4), -1, np.int32)
    stop[0, :2] = [2, V - 1]
    stop[1, 0] = 3
    processed = np.asarray(processed_logits(logits, metadata(3, stop_ids=stop, suppress_stop=np.array([True, False, True]))))
    want = np.tile(np.asarray(LOGITS), (3, 1))
    want[0, [2, V - 1]] = -np.inf
    np.testing.assert_array_equal(processed, want)


def draws(m, n=400):
    rows = np.repeat(np.asarray(LOGITS), n, axis=0)
    return np.asarray(sample(jnp.asarray(rows), m).tokens)


def test_filters_keep_only_allowed_tokens():
    n = 400
    hot = dict(temperature=np.full(n, 5.0, np.float32), seeds=np.arange(n, dtype=np.uint32))
    assert set(draws(metadata(n, **hot))) > {2, 3}  # high temperature spreads widely
    assert set(draws(metadata(n, **hot, top_k=np.full(n, 2, np.int32)))) == {2, 3}
    assert set(draws(metadata(n, **hot, min_p=np.full(n, 0.9, np.float32)))) <= {2, 3}
    def nucleus(p):
        return set(draws(metadata(n, temperature=np.ones(n, np.float32), seeds=np.arange(n, dtype=np.uint32),
                                  top_p=np.full(n, p, np.float32))))

    # softmax(LOGITS): p(2) = 0.44, p(3) = 0.40; top-p keeps the smallest prefix reaching p.
    assert nucleus(0.4) == {2}
    assert nucleus(0.5) == {2, 3}



def test_top_p_at_an_exact_tie_drops_the_token_that_starts_at_p():
    """The convention at a tie, as vLLM's: sorted by probability, descending, a token is kept iff the
    mass strictly before it is < top_p (at least one token is always kept). So the kept set is the
    smallest prefix whose mass reaches top_p, and a token whose preceding mass equals top_p exactly
    is dropped. (vLLM's apply_top_k_top_p_pytorch sorts ascending and masks a token when the
    cumulative mass up to and including it is <= 1 - top_p: the same rule.)

    Probabilities 1/2, 1/4, 1/8, 1/8 (the rest -inf) are exact in float32, so the ties are exact."""
    ln2 = np.float32(np.log(2))
    logits = np.full(V, -np.inf, np.float32)
    logits[[5, 2, 0, 7]] = [0.0, -ln2, -2 * ln2, -2 * ln2]  # shuffled, so the sort matters
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits)))
    assert probs[[5, 2, 0, 7]].tolist() == [0.5, 0.25, 0.125, 0.125]  # exact: the ties below are exact
    top_p = np.float32([0.5, np.nextafter(np.float32(0.5), np.float32(1)), 0.75])
    rows = len(top_p)
    kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(np.tile(logits, (rows, 1))), metadata(rows, top_p=top_p))))
    assert [set(np.flatnonzero(row).tolist()) for row in kept] == [
        {5},  # the mass before token 2 is exactly 0.5: dropped
        {5, 2},  # just above 0.5 it stays
        {5, 2},  # the mass before tokens 0 and 7 is exactly 0.75: dropped
    ]
    n = 200  # and the draws obey it
    drawn = sample(jnp.asarray(np.tile(logits, (n, 1))),
                   metadata(n, temperature=np.ones(n, np.float32), top_p=np.full(n, 0.5, np.float32)))
    assert set(np.asarray(drawn.tokens).tolist()) == {5}

def test_draws_depend_on_seed_and_token_index_not_on_the_row():
    n = 6
    m = metadata(n, temperature=np.full(n, 5.0, np.float32), seeds=np.full(n, 7, np.uint32),
                 token_index=np.array([0, 1, 2, 0, 1, 2], np.int32))
    tokens = np.asarray(sample(jnp.repeat(LOGITS, n, axis=0), m).tokens)
    assert tokens[:3].tolist() == tokens[3:].tolist()  # same (seed, index) in another row: same draw
    shuffled = metadata(n, temperature=np.full(n, 5.0, np.float32), seeds=np.full(n, 7, np.uint32),
                        token_index=np.array([2, 1, 0, 2, 1, 0], np.int32))
    again = np.asarray(sample(jnp.repeat(LOGITS, n, axis=0), shuffled).tokens)
    assert again[::-1][:3].tolist() == tokens[:3].tolist()


def test_logprobs_with_a_vocabulary_smaller_than_the_top_n():
    out = sample(LOGITS, metadata(1, need_logprobs=np.bool_(True)))
    ids = np.asarray(out.top_ids[0])
    assert ids[0] == 2 and ids[1] == 3
    assert np.isclose(float(out.logprob[0]), float(out.top_logprobs[0, 0]))
    assert np.isclose(np.exp(np.asarray(out.top_logprobs[0, :V])).sum(), 1.0, atol=1e-5)


def test_token_bitmask_masks_only_its_row():
    allowed = np.full((2, 1), -1, np.int32)
    allowed[0, 0] = (1 << 4) | (1 << 6)  # row 0 may only say token 4 or 6; row 1 is unconstrained
    logits = jnp.concatenate([LOGITS, LOGITS])
    out = sample(logits, metadata(2, token_bitmask=allowed, use_bitmask=np.bool_(True)))
    assert out.tokens.tolist() == [4, 2]
    # Sampled rows draw among the allowed tokens only; logprobs stay the raw model's.
    drawn = sample(logits, metadata(2, token_bitmask=allowed, use_bitmask=np.bool_(True), need_logprobs=np.bool_(True),
                                    temperature=np.ones(2, np.float32)))
    assert int(drawn.tokens[0]) in (4, 6)
    assert np.allclose(drawn.top_logprobs[0, :2], drawn.top_logprobs[1, :2])
    # The flag gates the work.
    assert sample(logits, metadata(2, token_bitmask=allowed)).tokens.tolist() == [2, 2]


def test_logit_bias_bans_and_forces_per_row():
    ids = np.array([[2, 0, 0], [7, 0, 0]], np.int32)
    values = np.array([[-100, 0, 0], [100, 0, 0]], np.float32)
    logits = jnp.concatenate([LOGITS, LOGITS])
    out = sample(logits, metadata(2, bias_ids=ids, bias_values=values, use_logit_bias=np.bool_(True)))
    assert out.tokens.tolist() == [3, 7]
    assert sample(logits, metadata(2, bias_ids=ids, bias_values=values)).tokens.tolist() == [2, 2]
    # A grammar outranks a bias: row 1 forces token 7, but its grammar allows only 1.
    allowed = np.array([[-1], [1 << 1]], np.int32)
    out = sample(logits, metadata(2, bias_ids=ids, bias_values=values, use_logit_bias=np.bool_(True),
                                  token_bitmask=allowed, use_bitmask=np.bool_(True)))
    assert out.tokens.tolist() == [3, 1]


def test_a_step_plans_sampling_metadata_is_the_samplers_pytree_in_numpy():
    """One class on both sides: the plan the host builds holds the sampler's SamplingMetadata in
    numpy, and it crosses into a jitted program as that class holding jax arrays, field for field."""
    from orca_jax.engine.step_plan import KVLayout, padding_plan

    plan = padding_plan(4, 2, KVLayout(num_pages=4, page_size=4, max_pages_per_seq=2, max_num_seqs=2), V)
    host = plan.sampling
    assert type(host) is SamplingMetadata and isinstance(host.temperature, np.ndarray)
    device = jax.jit(lambda m: m)(host)
    assert type(device) is SamplingMetadata and isinstance(device.temperature, jax.Array)
    names = [f.name for f in dataclasses.fields(SamplingMetadata)]
    leaves = {name for name in names if getattr(host, name) is not None}  # no penalties, no grammar: no [S, V] arrays
    assert leaves == set(names) - {"output_counts", "seen_tokens", "token_bitmask"}
    for name in leaves:
        np.testing.assert_array_equal(np.asarray(getattr(device, name)), getattr(host, name), err_msg=name)


def test_first_argmax_is_jnps_argmax_on_ties_nans_and_infinities():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((9, 50)).astype(np.float32)
    rows[0, [3, 7, 40]] = 9.0  # a tie: the first wins
    rows[1] = -np.inf  # every token masked: index 0
    rows[2, [5, 30]] = np.nan  # a NaN is the maximum: the first NaN
    rows[3, [6, 8]] = [np.nan, np.inf]
    rows[4, [2, 11]] = np.inf
    rows[5] = 0.0
    rows[5, 4] = -0.0  # equal zeros: the first
    rows[6, -1] = 100.0  # the last index
    got = np.asarray(first_argmax(jnp.asarray(rows)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(rows), axis=-1)))
    assert list(got[:7]) == [3, 0, 5, 6, 2, 0, 49]
    batched = np.asarray(first_argmax(jnp.asarray(rows.reshape(3, 3, 50))))  # any leading axes
    np.testing.assert_array_equal(batched.reshape(-1), got)


def test_logprobs_are_the_raw_log_softmax_bit_for_bit_whatever_the_rows_processing():
    """The sampled token's logprob and the top logprobs are entries of log_softmax of the raw logits
    (the sampler computes only its normalizer), for greedy and drawn rows, with and without a stage
    that changes the logits (a penalty here, which moves every row off the raw logits' best)."""
    vocab = 64
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((4, vocab)).astype(np.float32))
    counts = np.zeros((4, vocab), np.int32)
    counts[np.arange(4), np.asarray(logits).argmax(-1)] = 1
    wide = dict(token_bitmask=np.full((4, vocab // 32), -1, np.int32), output_counts=np.zeros((4, vocab), np.int32),
                seen_tokens=np.zeros((4, vocab), bool), need_logprobs=np.bool_(True))
    raw = np.asarray(jax.jit(jax.nn.log_softmax)(logits))
    for extra in (dict(), dict(temperature=np.float32([0, 0.8, 0, 0.8])),
                  dict(output_counts=counts, seen_tokens=counts > 0, presence_penalty=np.full(4, 50, np.float32),
                       use_penalties=np.bool_(True))):
        out = jax.jit(sample)(logits, metadata(4, **{**wide, **extra}))
        tokens = np.asarray(out.tokens)
        np.testing.assert_array_equal(np.asarray(out.logprob), raw[np.arange(4), tokens])
        np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-raw, axis=-1, kind="stable")[:, :20])
        np.testing.assert_array_equal(np.asarray(out.top_logprobs), -np.sort(-raw, axis=-1)[:, :20])
    assert (tokens != np.asarray(logits).argmax(-1)).all()


def test_a_step_where_no_request_asked_computes_no_logprobs():
    """The normalizer's exp over the vocabulary runs only in steps where some request asked for logprobs."""
    quiet, asked = (jax.jit(sample)(LOGITS, metadata(1, need_logprobs=np.bool_(flag))) for flag in (False, True))
    assert int(quiet.tokens[0]) == int(asked.tokens[0]) == 2
    assert float(quiet.logprob[0]) == 0 and not np.asarray(quiet.top_logprobs).any()
    assert float(asked.logprob[0]) == float(jax.nn.log_softmax(LOGITS)[0, 2]) < 0
