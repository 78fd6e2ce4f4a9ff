"""Speculative decoding on the device: token history, verification of drafts, n-gram proposals.

Token history. Beside its KV pages, the last pipeline stage keeps `token_pages` [P + 1, page]: the
token id of every cached K/V slot, written by the layers program at the step's `slot_mapping` (the
same slots as the K/V). A request's history is thus its block table read through `token_pages`;
pages shared through the prefix cache carry their tokens with them, preemption and recompute
rewrite them, and nothing is ever copied to the host to propose drafts.

Verification. A speculating sequence's logit rows are its last real token and then each draft; the
sampler draws every row's token as if the drafts before it were already outputs (randomness keyed
by seed and token index). Draft i is accepted when the token drawn at its row equals it, and all
drafts before it were accepted. With a point-mass proposal (an n-gram, or a greedy draft model)
this is rejection sampling under the coupling that shares the row's randomness: the draft is
accepted with probability p(draft), and when it is not, the drawn token follows p with the draft
removed, renormalised, which is the residual distribution (p - q)+ of Leviathan et al. (2023). The
output thus has the target's distribution exactly, and a seeded request gives the very tokens it
gives without speculation, alone or batched. Greedy rows (argmax) are the exact-match special case.

A draft model (runner/draft_model.py) proposes from a distribution q, not a point mass. Its rows at
temperature > 0 are verified by true rejection sampling (Leviathan et al., as vLLM's rejection
sampler): with u uniform, the draft d is accepted when u * q(d) < p(d) (probability min(1, p/q));
otherwise the row's token is drawn from the residual norm(max(0, p - q)). p is the sampler's own
final distribution at the row (processed, scaled and filtered logits), q the draft's at the same
row, so every emitted token follows p. The uniform, the residual draw and the draft's own draw are
keyed by (seed, token index) with distinct salts: seeded requests reproduce, batched or alone.

Proposal (prompt lookup, vLLM's "ngram"). After verification each proposing sequence's history ends
with its new token. The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are
looked for earlier in the history; at the latest match of the longest n, the up to k tokens that
followed it are the next step's drafts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from orca_jax.config import SpeculativeConfig
from orca_jax.model.sampler import (SamplerOutput, SamplingMetadata, draw_keys, first_argmax, processed_logits,
                                   scaled_logits)
from orca_jax.step_metadata import SpeculationMetadata

# Salts folded into a row's (seed, token index) key, so each use of randomness is independent of
# the target's own draw and of the others.
ACCEPT_SALT, RESIDUAL_SALT, DRAFT_SALT = 1, 2, 3


# The host builds it in numpy (engine/step_plan.py, without the block tables: the runner adds the
# plan's); here it holds jax arrays: one class, a pytree once registered (orca_jax/step_metadata.py).
jax.tree_util.register_dataclass(SpeculationMetadata)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpeculativeOutput:
    sampled: SamplerOutput  # [R]: the token drawn at every logit row
    accepted: Bool[Array, " R"]  # the row's draft was accepted
    drafts: Int[Array, "S_max K"]  # proposed for each sequence's next step
    num_drafts: Int[Array, " S_max"]  # how many of them are valid (0: no match)


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int  # k
    lookup_min: int
    lookup_max: int

    @classmethod
    def from_config(cls, spec: SpeculativeConfig) -> NgramProposer:
        return cls(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


@dataclasses.dataclass(frozen=True)
class DraftModelProposer:
    """Drafts from a draft model (runner/draft_model.py runs it); `model` is its Decoder."""

    num_speculative_tokens: int  # k
    name: str  # the preset name or checkpoint directory it came from
    config: Any  # its ModelConfig
    model: Any = dataclasses.field(repr=False, compare=False, default=None)


def salted_keys(seeds: Int[Array, " R"], token_index: Int[Array, " R"], salt: int) -> jax.Array:
    return jax.vmap(lambda key: jax.random.fold_in(key, salt))(draw_keys(seeds, token_index))


def draft_scaled_logits(logits: Float[Array, "R V"], temperature: Float[Array, " R"]) -> Float[Array, "R V"]:
    """The draft model's q = softmax of these: its logits over the request's temperature (no
    filters: any q keeps rejection sampling exact). The draft draws from it and verification
    reads it, so both use this one function."""
    return logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]


def rejection_sample(logits: Float[Array, "R V"], sampled: SamplerOutput, sampling: SamplingMetadata,
                     m: SpeculationMetadata, draft_probs: Float[Array, "R V"]) -> SamplerOutput:
    """Each row that checks a draft-model draft at temperature > 0 gets the draft when u * q(d) <
    p(d), else a draw from norm(max(0, p - q)); other rows keep the sampler's token. Logprobs are
    those of the raw model distribution at the row's new token, as the sampler reports them (in steps
    where a request asked for them)."""
    rows = jnp.arange(logits.shape[0])
    checks = (m.row_draft >= 0) & (sampling.temperature > 0)
    draft = jnp.maximum(m.row_draft, 0)
    p = jax.nn.softmax(scaled_logits(processed_logits(logits, sampling), sampling), axis=-1)
    p_draft, q_draft = p[rows, draft], draft_probs[rows, draft]
    u = jax.vmap(lambda key: jax.random.uniform(key))(salted_keys(sampling.seeds, sampling.token_index, ACCEPT_SALT))
    accept = (q_draft > 0) & (u * q_draft < p_draft)
    residual = jnp.maximum(p - draft_probs, 0.0)
    # p == q leaves no residual (and then every draft is accepted); fall back to p to stay finite.
    residual = jnp.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(
        salted_keys(sampling.seeds, sampling.token_index, RESIDUAL_SALT))
    recovered = first_argmax(jnp.log(residual) + gumbel)  # Gumbel-max: a draw from norm(residual)
    tokens = jnp.where(checks, jnp.where(accept, draft, recovered), sampled.tokens).astype(jnp.int32)
    # As the sampler: only a step where a request asked for logprobs computes them (else its zeros stay).
    logprob = jax.lax.cond(
        sampling.need_logprobs,
        lambda: jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0],
        lambda: sampled.logprob)
    return dataclasses.replace(sampled, tokens=tokens, logprob=logprob)


def write_tokens(token_pages: Int[Array, "P page"], token_ids: Int[Array, " T"],
                 slot_mapping: Int[Array, " T"]) -> Int[Array, "P page"]:
    """Records each new token at its K/V slot (padding writes to the scratch page)."""
    return token_pages.reshape(-1).at[slot_mapping].set(token_ids).reshape(token_pages.shape)


def accepted_rows(tokens: Int[Array, " R"], m: SpeculationMetadata) -> Bool[Array, " R"]:
    """A row's draft is accepted when the row drew it and every earlier row of its sequence was
    accepted too (the sequence's drafts are a chain: after the first miss none count)."""
    match = tokens == m.row_draft  # a row without a draft (-1) never matches
    misses = jnp.cumsum(~match)
    misses_before_sequence = misses[m.row_first] - (~match[m.row_first]).astype(misses.dtype)
    return match & (misses == misses_before_sequence)


def propose(proposer: NgramProposer, token_pages: Int[Array, "P page"], tokens: Int[Array, " R"],
            accepted: Bool[Array, " R"], m: SpeculationMetadata) -> tuple[Int[Array, "S K"], Int[Array, " S"]]:
    """The next step's drafts of every proposing sequence, from its history on the device."""
    num_seqs = m.block_tables.shape[0]
    rows = jnp.arange(num_seqs)
    num_accepted = jax.ops.segment_sum(accepted.astype(jnp.int32), m.row_seq, num_segments=num_seqs)
    new_token = tokens[m.seq_first_row + num_accepted]  # the first row that was not accepted drew it
    history = token_pages[m.block_tables].reshape(num_seqs, -1)  # [S, M] positions 0..M-1
    length = m.seq_history_len + num_accepted  # positions < length are in the pages
    history = history.at[rows, length].set(new_token, mode="drop")
    last = length  # the newest token's position: the history is positions 0..last
    max_len = history.shape[1]
    ends = jnp.arange(max_len)[None, :]  # candidate match ends e: history[e - n + 1 .. e] == suffix
    best_end = jnp.full(num_seqs, -1)
    matching = jnp.ones_like(history, dtype=bool)
    for j in range(proposer.lookup_max):
        shifted = jnp.pad(history, ((0, 0), (j, 0)), constant_values=-1)[:, :max_len]  # history[e - j]
        wanted = jnp.where(last - j >= 0, jnp.take_along_axis(history, jnp.maximum(last - j, 0)[:, None], 1)[:, 0], -2)
        matching = matching & (shifted == wanted[:, None])
        if j + 1 >= proposer.lookup_min:
            # A match must end before the newest token, so that at least one token follows it.
            found = jnp.max(jnp.where(matching & (ends < last[:, None]), ends, -1), axis=1)
            best_end = jnp.where(found >= 0, found, best_end)  # longer n-grams override shorter ones
    offsets = best_end[:, None] + 1 + jnp.arange(proposer.num_speculative_tokens)[None, :]
    valid = (best_end[:, None] >= 0) & (offsets <= last[:, None]) & m.seq_proposes[:, None]
    drafts = jnp.take_along_axis(history, jnp.minimum(offsets, max_len - 1), 1)
    return jnp.where(valid, drafts, -1).astype(jnp.int32), valid.sum(axis=1).astype(jnp.int32)


def no_drafts(num_seqs: int, k: int) -> tuple[Int[Array, "S K"], Int[Array, " S"]]:
    return jnp.full((num_seqs, k), -1, jnp.int32), jnp.zeros(num_seqs, jnp.int32)


def verify_and_propose(proposer: NgramProposer | DraftModelProposer, token_pages, logits: Float[Array, "R V"],
                       sampled: SamplerOutput, sampling: SamplingMetadata, m: SpeculationMetadata,
                       draft_probs: Float[Array, "R V"] | None) -> SpeculativeOutput:
    """Verifies the step's drafts; with n-grams also proposes the next ones (a draft model's come
    from its own program after this one: the drafts here are then none)."""
    num_seqs, k = m.block_tables.shape[0], proposer.num_speculative_tokens
    if draft_probs is not None:
        random_drafts = ((m.row_draft >= 0) & (sampling.temperature > 0)).any()
        sampled = jax.lax.cond(random_drafts, lambda s: rejection_sample(logits, s, sampling, m, draft_probs),
                               lambda s: s, sampled)
    accepted = accepted_rows(sampled.tokens, m)
    if isinstance(proposer, DraftModelProposer):
        drafts, num_drafts = no_drafts(num_seqs, k)
        return SpeculativeOutput(sampled=sampled, accepted=accepted, drafts=drafts, num_drafts=num_drafts)

    def no_proposals(*_):
        return no_drafts(num_seqs, k)

    drafts, num_drafts = jax.lax.cond(m.any_proposes, lambda *a: propose(proposer, *a), no_proposals,
                                      token_pages, sampled.tokens, accepted, m)
    return SpeculativeOutput(sampled=sampled, accepted=accepted, drafts=drafts, num_drafts=num_drafts)
