"""The n-gram proposer on the device (runner/speculation.py `propose`): which match it takes, on a
hand-made history of one sequence (page size 4, the new token appended at the history's end)."""

import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.runner.speculation import NgramProposer, SpeculationMetadata, propose

PAGE = 4


def proposal(history, new_token, lookup_min, lookup_max=4, k=4):
    """The drafts proposed after a one-row step (no drafts verified) that drew `new_token`."""
    pages = -(-(len(history) + 1) // PAGE)
    token_pages = np.full((pages + 1, PAGE), -1, np.int32)  # the last page is the scratch page
    token_pages.reshape(-1)[:len(history)] = history
    m = SpeculationMetadata(
        row_draft=jnp.full(1, -1, jnp.int32), row_first=jnp.zeros(1, jnp.int32), row_seq=jnp.zeros(1, jnp.int32),
        seq_first_row=jnp.zeros(1, jnp.int32), seq_history_len=jnp.asarray([len(history)], jnp.int32),
        seq_proposes=jnp.ones(1, bool), any_proposes=jnp.asarray(True),
        seq_num_slots=jnp.asarray([pages * PAGE], jnp.int32), block_tables=jnp.arange(pages, dtype=jnp.int32)[None])
    drafts, num = propose(NgramProposer(k, lookup_min, lookup_max), jnp.asarray(token_pages),
                          jnp.asarray([new_token], jnp.int32), jnp.zeros(1, bool), m)
    return [int(t) for t in np.asarray(drafts)[0, :int(num[0])]]


@pytest.mark.parametrize("lookup_min,expected", [(1, [30, 40, 50, 99]), (2, [])])
def test_a_lone_token_matches_only_when_lookup_min_is_1(lookup_min, expected):
    # The new token 20 follows 99: the pair (99, 20) is nowhere earlier, 20 alone is (position 1).
    assert proposal([10, 20, 30, 40, 50, 99], 20, lookup_min) == expected


@pytest.mark.parametrize("lookup_min", [1, 2])
def test_the_longest_match_wins_over_a_later_shorter_one(lookup_min):
    # (99, 20) matches at positions 0-1; 20 alone matches later, at 4: the pair's continuation is taken.
    assert proposal([99, 20, 31, 7, 20, 32, 5, 99], 20, lookup_min) == [31, 7, 20, 32]


def test_drafts_stop_at_the_newest_token():
    # 20 alone matches at position 3: only the tokens up to the new one follow it.
    assert proposal([1, 2, 3, 20, 8], 20, lookup_min=1) == [8, 20]
