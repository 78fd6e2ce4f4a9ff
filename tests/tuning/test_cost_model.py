"""The cost model (orca_jax/tuning/cost_model.py): fitted from timings made by a known model over the
measuring grid, it recovers that model's coefficients; it prices a simulated step at its bucket."""

import random

import pytest

from orca_jax.engine.step_plan import Buckets
from orca_jax.tuning.cost_model import DECODE_TERMS, PREFILL_TERMS, CostModel, Timing, fit
from orca_jax.tuning.measure import grid
from orca_jax.tuning.simulate import SimStep

TRUE = CostModel(decode={"intercept_s": 0.021, "per_seq_s": 0.0015, "per_1k_attended_s": 0.004},
                 prefill={"intercept_s": 0.033, "per_token_s": 0.0004, "per_seq_s": 0.0021, "per_1k_attended_s": 0.0009})
BUCKETS = Buckets.for_limits(1024, 64)


def timings(model: CostModel, noise: float = 0.0, seed: int = 0) -> list[Timing]:
    """The measuring grid's shapes, each timed by `model`, times a seeded factor within 1 +- noise."""
    rng = random.Random(seed)
    rows = []
    for chunks in grid(BUCKETS.tokens, BUCKETS.seqs, max_model_len=2048):
        t, s = BUCKETS.pick(sum(n for _, n in chunks), len(chunks))
        rows.append(Timing(chunks, t, s, model.device_seconds(chunks, t, s) * (1 + rng.uniform(-noise, noise))))
    return rows


def test_the_fit_recovers_the_coefficients_of_exact_timings():
    fitted = fit(timings(TRUE), host_s_per_step=0.003)
    for regime, terms in (("decode", DECODE_TERMS), ("prefill", PREFILL_TERMS)):
        for term in terms:
            assert getattr(fitted, regime)[term] == pytest.approx(getattr(TRUE, regime)[term], rel=1e-6), (regime, term)
        assert fitted.fit_error[regime]["max_relative"] < 1e-6
    assert fitted.host_s_per_step == 0.003


def test_the_fit_stays_close_under_measurement_noise():
    fitted = fit(timings(TRUE, noise=0.05, seed=3))
    for regime, terms in (("decode", DECODE_TERMS), ("prefill", PREFILL_TERMS)):
        for term in terms:
            assert getattr(fitted, regime)[term] == pytest.approx(getattr(TRUE, regime)[term], rel=0.25), (regime, term)
        assert fitted.fit_error[regime]["rms_relative"] < 0.05


def test_a_cost_is_never_negative_and_too_few_rows_are_refused():
    # Timings that fall with more sequences would give a negative per-sequence cost by plain least squares.
    rows = [Timing(((64, 1),) * s, s, s, 0.05 - 0.001 * s) for s in (1, 2, 4, 8, 16)]
    rows += [Timing(((0, t),), t, 1, 0.01 + 0.001 * t) for t in (2, 4, 8, 16, 32)]
    fitted = fit(rows)
    assert min(fitted.decode.values()) >= 0 and min(fitted.prefill.values()) >= 0
    with pytest.raises(ValueError, match="decode steps' cost needs at least 4"):
        fit(rows[5:] + rows[:2])


def test_a_step_is_priced_at_its_bucket_with_what_its_tokens_attend_to():
    price = TRUE.pricer(max_num_seqs=16, max_num_batched_tokens=384)  # token buckets 1, 2, ..., 256, 384
    decodes = SimStep(((100, 1),) * 5)  # 5 sequences: bucket 8, each token reads 101 positions
    assert price(decodes) == pytest.approx(0.021 + 0.0015 * 8 + 0.004 * 5 * 101 / 1000)
    mixed = SimStep(((100, 1), (0, 299)))  # 300 tokens: bucket 384; the chunk reads 299 * 300 / 2
    assert price(mixed) == pytest.approx(0.033 + 0.0004 * 384 + 0.0021 * 2 + 0.0009 * (101 + 299 * 300 / 2) / 1000)
    static = SimStep(((100, 1),), num_padding_seqs=2)  # a static batch's finished members take rows too
    assert price(static) == pytest.approx(0.021 + 0.0015 * 4 + 0.004 * (101 + 2) / 1000)


def test_the_model_round_trips_through_json():
    model = fit(timings(TRUE), host_s_per_step=0.002)
    assert CostModel.from_json(model.to_json()) == model
