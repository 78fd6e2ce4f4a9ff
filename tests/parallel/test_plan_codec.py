"""The multi-host plan encoding: a plan round-trips exactly, and anything that is not an encoded
plan (a pickle included) is refused without being run."""

import dataclasses
import os
import pickle

import numpy as np
import pytest

from orca_jax.engine.step_plan import KVLayout, bitmask_width, padding_plan
from orca_jax.parallel.multihost import layout_differences
from orca_jax.parallel.plan_codec import decode_plan, encode_plan

KV = KVLayout(num_pages=64, page_size=16, max_pages_per_seq=32, max_num_seqs=8)
VOCAB = 100


def busy_plan(penalties: bool):
    """A plan with every kind of content: real rows, used block-table columns, a bitmask, logit
    bias, stop ids and (optionally) the [S, V] penalty arrays."""
    rng = np.random.default_rng(1)
    plan = padding_plan(16, 4, KV, VOCAB)
    plan.token_ids[:10] = rng.integers(0, VOCAB, 10)
    plan.positions[:10] = np.arange(10)
    plan.segment_ids[:10] = [0] * 6 + [1] * 4
    plan.block_tables[:2, :5] = rng.integers(0, 64, (2, 5))
    plan.kv_lens[:2] = [6, 4]
    plan.logits_index[:2] = [5, 9]
    plan.sampling.temperature[:2] = [0.0, 0.7]
    plan.sampling.seeds[:2] = [1, 4_000_000_000]
    plan.sampling.stop_ids[1, :2] = [2, 7]
    plan.sampling.token_bitmask = np.full((4, bitmask_width(VOCAB)), -1, np.int32)
    plan.sampling.token_bitmask[0, 1] = 5
    plan.sampling.use_bitmask = np.bool_(True)
    plan.sampling.bias_ids[1, 0], plan.sampling.bias_values[1, 0] = 9, -3.5
    if penalties:
        plan.sampling.output_counts = rng.integers(0, 3, (4, VOCAB)).astype(np.int32)
        plan.sampling.seen_tokens = plan.sampling.output_counts > 0
        plan.sampling.use_penalties = np.bool_(True)
    plan.num_real_tokens, plan.num_padding_seqs = 10, 1
    return plan


def assert_same(decoded, plan, penalties=True):
    for field in ("token_ids", "positions", "segment_ids", "slot_mapping", "block_tables", "kv_lens", "logits_index"):
        np.testing.assert_array_equal(getattr(decoded, field), getattr(plan, field), err_msg=field)
        assert getattr(decoded, field).dtype == getattr(plan, field).dtype
    for field in dataclasses.fields(plan.sampling):
        got, want = getattr(decoded.sampling, field.name), getattr(plan.sampling, field.name)
        if field.name in ("output_counts", "seen_tokens") and not penalties:
            assert got is None
        elif want is None:
            assert got is None, field.name
        else:
            np.testing.assert_array_equal(got, want, err_msg=field.name)
            assert np.asarray(got).dtype == np.asarray(want).dtype, field.name
    assert (decoded.num_real_tokens, decoded.num_padding_seqs) == (plan.num_real_tokens, plan.num_padding_seqs)


@pytest.mark.parametrize("penalties", [False, True])
def test_an_encoded_plan_round_trips_exactly(penalties):
    plan = busy_plan(penalties)
    assert_same(decode_plan(encode_plan(plan)), plan)


def test_a_plan_without_a_grammar_carries_no_bitmask():
    plan = busy_plan(False)
    with_bitmask = encode_plan(plan)
    plan.sampling.token_bitmask, plan.sampling.use_bitmask = None, np.bool_(False)
    encoded = encode_plan(plan)
    assert len(encoded) < len(with_bitmask)
    decoded = decode_plan(encoded)
    assert decoded.sampling.token_bitmask is None
    assert_same(decoded, plan, penalties=False)


def test_a_speculating_plan_round_trips_its_draft_arrays():
    """Speculative decoding's per-row arrays travel too (a follower's runner verifies and proposes
    like the leader's); a plan without them decodes without them."""
    from orca_jax.step_metadata import SpeculationMetadata

    plan = busy_plan(False)
    assert decode_plan(encode_plan(plan)).speculation is None
    rows = plan.logits_index.shape[0]
    plan.speculation = SpeculationMetadata.empty(rows, KV.max_num_seqs)
    plan.speculation.row_draft[:3] = [7, 8, -1]
    plan.speculation.seq_history_len[:2] = [6, 4]
    plan.speculation.seq_proposes[0] = True
    plan.speculation.any_proposes = np.bool_(True)
    decoded = decode_plan(encode_plan(plan)).speculation
    for field in dataclasses.fields(SpeculationMetadata):
        got, want = getattr(decoded, field.name), getattr(plan.speculation, field.name)
        np.testing.assert_array_equal(got, want, err_msg=field.name)
        assert np.asarray(got).dtype == np.asarray(want).dtype, field.name


def test_padding_columns_are_not_sent_and_penalties_only_when_asked():
    plan = busy_plan(penalties=True)
    full, without = encode_plan(plan), encode_plan(plan, with_penalties=False)
    assert_same(decode_plan(without), plan, penalties=False)
    penalty_bytes = plan.sampling.output_counts.nbytes + plan.sampling.seen_tokens.nbytes
    assert penalty_bytes <= len(full) - len(without) < penalty_bytes + 200  # + their two header entries
    # Of the [8, 32] block tables only the 5 used columns travel.
    assert len(without) < 3000


@pytest.mark.parametrize("message", [
    b"",
    b"ORCAPLAN1",
    pickle.dumps({"token_ids": np.zeros(4, np.int32)}),
    lambda data: data[:-1],  # truncated
    lambda data: data + b"\0",  # stray bytes
    # Same-length edits of the header (JSON allows the trailing blanks):
    lambda data: data.replace(b'"int32"', b'"O"    ', 1),  # an object dtype, which numpy would unpickle
    lambda data: data.replace(b'"int32"', b'"V4"   ', 1),  # a dtype of the right size, not a plan's
    lambda data: data.replace(b'"token_ids"', b'"__class__"', 1),  # an unknown field
])
def test_anything_but_an_encoded_plan_is_refused(message):
    if callable(message):
        message = message(encode_plan(busy_plan(penalties=False)))
    with pytest.raises(ValueError):
        decode_plan(message)


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /dev/null",))


def test_a_pickle_that_would_run_code_is_refused_not_run():
    with pytest.raises(ValueError, match="not an encoded step plan"):
        decode_plan(pickle.dumps(RunsCode()))


def test_layout_differences_name_both_settings():
    leader = {"kv_layout.max_num_seqs": "4", "buckets.seqs": "(1, 2, 4)", "attention_impl": "'native'"}
    other = {**leader, "kv_layout.max_num_seqs": "8"}
    assert layout_differences(leader, other, 1) == ["kv_layout.max_num_seqs: leader 4, process 1 8"]
    assert layout_differences(leader, dict(leader), 1) == []
