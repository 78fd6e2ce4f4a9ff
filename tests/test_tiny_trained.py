"""The committed tiny model has learned its counting language, so tests can check *right* outputs."""

import numpy as np
import pytest

from orca_jax.checkpoint.train_tiny import BOS, EOS, counting_sequence, packed_batch, train
from orca_jax.model.recompute import RecomputeGenerator


@pytest.mark.parametrize("start, step", [(0, 1), (3, 2), (10, 3), (50, 4), (61, 1)])
def test_continues_the_count_and_stops(tiny_trained, start, step):
    expected = counting_sequence(start, step)
    generator = RecomputeGenerator(tiny_trained.model)
    generated = list(generator.greedy(expected[:3], 100, stop_token_ids=[EOS]))
    assert generated == expected[3:]
    assert generated[-1] == EOS


def test_text_prompt(tiny_trained):
    tok = tiny_trained.tokenizer
    generated = list(RecomputeGenerator(tiny_trained.model).greedy(tok.encode("40 44"), 20, [EOS]))
    assert tok.decode(generated, skip_special_tokens=True) == "48 52 56 60"


def test_packed_batch_layout():
    batch = packed_batch(np.random.default_rng(0), 128)
    ids, segments = batch["token_ids"], batch["segment_ids"]
    starts = np.flatnonzero(batch["positions"] == 0)
    assert all(ids[s] == BOS for s in starts if segments[s] >= 0)
    real = segments >= 0
    # Targets are the next token of the same sentence; masked targets are never learned.
    same_next = np.append(segments[1:] == segments[:-1], False)
    assert np.all(batch["loss_mask"][~(real & same_next)] == 0)
    np.testing.assert_array_equal(batch["targets"][:-1][same_next[:-1]], ids[1:][same_next[:-1]])


def test_training_reduces_the_loss():
    _, losses = train(steps=30, num_tokens=256)
    assert np.mean(losses[-5:]) < 0.8 * losses[0]
