"""Rejection sampling against a draft model's q (runner/speculation.py), on hand-made distributions:
many seeded rows, each checking a draft drawn from q, must emit tokens that follow the target's p
(its final distribution: temperature and top-k included), and accept a draft with probability
sum_x min(p(x), q(x))."""

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from orca_jax.model.sampler import sample
from orca_jax.runner.speculation import SpeculationMetadata, accepted_rows, rejection_sample

from ..model.test_sampler import V, metadata

N = 20_000  # rows, one seed each
LOGITS = np.asarray([0.0, 1.0, 3.0, 2.9, 0.5, -1.0, 0.0, 0.0], np.float32)
Q = np.asarray([0.05, 0.4, 0.05, 0.1, 0.3, 0.05, 0.05, 0.0], np.float32)  # far from p, 0 on token 7


def speculation(drafts):
    rows = np.arange(len(drafts), dtype=np.int32)
    return SpeculationMetadata(
        row_draft=jnp.asarray(drafts), row_first=jnp.asarray(rows), row_seq=jnp.asarray(rows),
        seq_first_row=jnp.zeros(1, jnp.int32), seq_history_len=jnp.zeros(1, jnp.int32),
        seq_proposes=jnp.zeros(1, bool), any_proposes=jnp.asarray(False), seq_num_slots=jnp.zeros(1, jnp.int32),
        block_tables=jnp.zeros((1, 1), jnp.int32))


def target(temperature, top_k):
    scaled = LOGITS.astype(np.float64) / temperature
    if top_k:
        scaled = np.where(scaled >= np.sort(scaled)[-top_k], scaled, -np.inf)
    p = np.exp(scaled - scaled.max())
    return p / p.sum()


def run(temperature, top_k, order=slice(None)):
    """Row i has seed order[i] and the draft drawn for it."""
    seeds = np.arange(N, dtype=np.uint32)[order]
    m = metadata(N, temperature=np.full(N, temperature, np.float32), top_k=np.full(N, top_k, np.int32),
                 seeds=seeds, token_index=np.full(N, 5, np.int32),
                 output_counts=np.zeros((N, V), np.int32), seen_tokens=np.zeros((N, V), bool))
    drafts = np.asarray(jax.random.categorical(jax.random.key(7), jnp.log(jnp.asarray(Q)), shape=(N,)), np.int32)[order]
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (N, V))
    sampled = rejection_sample(logits, sample(logits, m), m, speculation(drafts), jnp.broadcast_to(jnp.asarray(Q),
                                                                                                   (N, V)))
    tokens = np.asarray(sampled.tokens)
    accepted = np.asarray(accepted_rows(sampled.tokens, speculation(drafts)))
    return tokens, accepted, drafts


def test_emitted_tokens_follow_p_and_drafts_pass_at_the_overlap():
    for temperature, top_k in ((1.0, 0), (0.7, 3)):
        p = target(temperature, top_k)
        tokens, accepted, drafts = run(temperature, top_k)
        observed = np.bincount(tokens, minlength=V)
        assert observed[p == 0].sum() == 0  # nothing outside top-k, nothing q alone proposes
        _, p_value = stats.chisquare(observed[p > 0], p[p > 0] * N)
        assert p_value > 0.001, (temperature, top_k, observed, p * N)
        assert np.all(tokens[accepted] == drafts[accepted])
        overlap = np.minimum(p, Q).sum()  # the chance that a draft from q passes against p
        assert abs(accepted.mean() - overlap) < 4 * np.sqrt(overlap * (1 - overlap) / N)


def test_draws_are_keyed_by_seed_and_token_index_not_the_row():
    tokens, _, _ = run(1.0, 0)
    reversed_rows, _, _ = run(1.0, 0, order=slice(None, None, -1))
    assert np.array_equal(reversed_rows, tokens[::-1])


def test_logprobs_follow_the_emitted_token_only_when_asked():
    """A row's logprob is the raw distribution's at the token it emits; in a step where no request
    asked for logprobs none is computed (zeros, as the sampler leaves them)."""
    rows = 64
    drafts = np.arange(rows, dtype=np.int32) % V
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (rows, V))
    q = jnp.broadcast_to(jnp.asarray(Q), (rows, V))
    spec = speculation(drafts)
    for asked in (False, True):
        m = metadata(rows, temperature=np.ones(rows, np.float32), need_logprobs=np.bool_(asked))
        out = rejection_sample(logits, sample(logits, m), m, spec, q)
        expected = np.asarray(jax.nn.log_softmax(jnp.asarray(LOGITS)))[np.asarray(out.tokens)] if asked else 0
        np.testing.assert_allclose(np.asarray(out.logprob), expected, rtol=1e-6)
