"""The cost model (orca_jax/tuning/cost_model.py): fitted from timings made by a known model over the
measuring grid, it recovers that model's coefficients; it prices a simulated step at its bucket,
interpolating buckets that were not measured."""

import dataclasses
import random

import pytest

from orca_jax.engine.step_plan import Buckets
from orca_jax.tuning.cost_model import CostModel, Timing, fit, interpolate
from orca_jax.tuning.measure import grid
from orca_jax.tuning.simulate import SimStep

BUCKETS = Buckets.for_limits(1024, 64)
# Bases that are no straight line in the bucket, as measured ones are not.
TRUE = CostModel(decode_base_s={s: 0.02 + 0.001 * s + 0.004 * (s >= 16) for s in BUCKETS.seqs},
                 decode_per_1k_attended_s=0.004,
                 prefill_base_s={t: 0.03 + 0.0012 * t + 0.003 * (t <= 32) for t in BUCKETS.tokens if t >= 2},
                 prefill_per_seq_s=0.0009, prefill_per_1k_attended_s=0.0009)


def timings(model: CostModel, noise: float = 0.0, seed: int = 0) -> list[Timing]:
    """The measuring grid's shapes, each timed by `model`, times a seeded factor within 1 +- noise."""
    rng = random.Random(seed)
    rows = []
    for chunks in grid(BUCKETS.tokens, BUCKETS.seqs, max_model_len=2048):
        t, s = BUCKETS.pick(sum(n for _, n in chunks), len(chunks))
        rows.append(Timing(chunks, t, s, model.device_seconds(chunks, t, s) * (1 + rng.uniform(-noise, noise))))
    return rows


def coefficients(model: CostModel) -> dict:
    return {**{f"decode {s}": v for s, v in model.decode_base_s.items()},
            **{f"prefill {t}": v for t, v in model.prefill_base_s.items()},
            "decode attended": model.decode_per_1k_attended_s, "prefill per seq": model.prefill_per_seq_s,
            "prefill attended": model.prefill_per_1k_attended_s}


def test_the_fit_recovers_the_coefficients_of_exact_timings():
    fitted = fit(timings(TRUE), host_s_per_step=0.003, host_s_per_seq=0.0001)
    true = coefficients(TRUE)
    got = coefficients(fitted)
    assert got.keys() == true.keys()
    for name, value in true.items():
        assert got[name] == pytest.approx(value, rel=1e-6), name
    assert max(e["max_relative"] for e in fitted.fit_error.values()) < 1e-6
    assert (fitted.host_s_per_step, fitted.host_s_per_seq) == (0.003, 0.0001)


def test_the_fit_stays_close_under_measurement_noise():
    fitted = fit(timings(TRUE, noise=0.05, seed=3))
    got = coefficients(fitted)
    for name, value in coefficients(TRUE).items():
        assert got[name] == pytest.approx(value, rel=0.1 if "attended" not in name and "seq" not in name else 0.3), name
    assert max(e["rms_relative"] for e in fitted.fit_error.values()) < 0.05


def test_a_cost_is_never_negative_and_too_few_rows_are_refused():
    # Timings that fall with attention would give it a negative cost by plain least squares.
    rows = [Timing(((c, 1),) * s, s, s, 0.05 - 0.00001 * c) for s in (1, 2, 4) for c in (10, 500)]
    rows += [Timing(((c, t),), t, 1, 0.01 + 0.001 * t - 0.00001 * c) for t in (2, 4, 8) for c in (0, 500)]
    fitted = fit(rows)
    assert fitted.decode_per_1k_attended_s >= 0 and fitted.prefill_per_1k_attended_s >= 0
    assert min(fitted.decode_base_s.values()) >= 0
    with pytest.raises(ValueError, match="decode steps' cost needs more measured steps than its 2 terms"):
        fit(rows[6:] + rows[:2])  # one decode bucket, twice: its base and the attention term from 2 rows


def test_a_step_is_priced_at_its_bucket_with_what_its_tokens_attend_to():
    host = 0.001
    model = CostModel(TRUE.decode_base_s, 0.004, TRUE.prefill_base_s, 0.0009, 0.0009, host_s_per_step=host,
                      host_s_per_seq=0.0001)
    price = model.pricer(max_num_seqs=16, max_num_batched_tokens=384)  # token buckets 1, 2, ..., 256, 384
    decodes = SimStep(((100, 1),) * 5)  # 5 sequences: bucket 8, each token reads 101 positions
    assert price(decodes) == pytest.approx(host + 0.0005 + TRUE.decode_base_s[8] + 0.004 * 5 * 101 / 1000)
    mixed = SimStep(((100, 1), (0, 299)))  # 300 tokens: bucket 384, between the measured 256 and 512
    base_384 = (TRUE.prefill_base_s[256] + TRUE.prefill_base_s[512]) / 2
    assert price(mixed) == pytest.approx(host + 0.0002 + base_384 + 0.0009 * 2 + 0.0009 * (101 + 299 * 300 / 2) / 1000)
    static = SimStep(((100, 1),), num_padding_seqs=2)  # a static batch's finished members take rows too
    assert price(static) == pytest.approx(host + 0.0001 + TRUE.decode_base_s[4] + 0.004 * (101 + 2) / 1000)


def test_interpolation_between_and_beyond_the_measured_buckets():
    table = {64: 1.0, 128: 2.0, 256: 3.0}
    assert interpolate(table, 128) == 2.0
    assert interpolate(table, 192) == pytest.approx(2.5)
    assert interpolate(table, 512) == pytest.approx(5.0)  # the last segment's line
    assert interpolate(table, 32) == pytest.approx(0.5)  # the first segment's line
    assert interpolate({64: 1.0}, 512) == 1.0


def test_the_model_round_trips_through_json():
    model = fit(timings(TRUE), host_s_per_step=0.002)
    assert CostModel.from_json(model.to_json()) == model


def test_decodes_beside_a_prompt_chunk_are_priced_at_their_own_rate():
    """Under the chunked policy a loaded step is a prompt chunk beside many decodes, and a decode row's
    attention costs per position what a prompt token's does not (4-5x on a Zen 4). Timings from a
    model where it does: the fit over the measuring grid recovers that rate, and prices a chunk
    beside 40 decodes at a 1024-token context as the model does (priced at the prompt tokens' rate,
    it came out ~40% cheap: the simulated prefill ran fast and the TTFT tail short)."""
    true = dataclasses.replace(TRUE, prefill_per_1k_decode_attended_s=0.004)
    fitted = fit(timings(true))
    assert fitted.prefill_per_1k_decode_attended_s == pytest.approx(0.004, rel=1e-6)
    assert fitted.prefill_per_1k_attended_s == pytest.approx(0.0009, rel=1e-6)
    chunks = ((1024, 1),) * 40 + ((0, 88),)
    price = fitted.pricer(max_num_seqs=64, max_num_batched_tokens=128)
    assert price(SimStep(chunks)) == pytest.approx(true.device_seconds(chunks, 128, 64), rel=1e-6)
    assert price(SimStep(chunks)) > TRUE.device_seconds(chunks, 128, 64) + 0.1  # 40 x 1025 x 3.1 us more


@pytest.mark.parametrize("seed", range(4))
def test_noisy_timings_are_not_priced_below_their_total(seed):
    """Weighted by 1 / the measured time, a row measured slow counts less than one measured fast, and
    the fit comes out cheap: 2.5-4% below the grid's measured total at +-30% noise (12% on a loaded
    machine's prefill steps), which the TTFT tail at the capacity multiplies. Weighted by the fit's
    own prices, the total is kept."""
    rows = timings(TRUE, noise=0.3, seed=seed)
    fitted = fit(rows)
    priced = sum(fitted.device_seconds(t.chunks, t.token_bucket, t.seq_bucket) for t in rows)
    assert priced == pytest.approx(sum(t.seconds for t in rows), rel=0.01)


def test_a_scaled_model_prices_every_step_that_many_times_over():
    """`tune --max-rate` searches with every step priced (1 + margin) times: every term scales, the
    host's and the decode rows' beside a chunk included, so no kind of step escapes the margin."""
    model = dataclasses.replace(TRUE, prefill_per_1k_decode_attended_s=0.004, host_s_per_step=0.003,
                                host_s_per_seq=0.0004)
    steps = [SimStep(((300, 1),) * 5), SimStep(((0, 100),)), SimStep(((1024, 1),) * 40 + ((64, 88),)),
             SimStep(((10, 1),) * 3, num_padding_seqs=2), SimStep(((0, 48),) * 3)]  # 48: between token buckets
    price, dearer = (m.pricer(max_num_seqs=64, max_num_batched_tokens=1024) for m in (model, model.scaled(1.1)))
    for step in steps:
        assert dearer(step) == pytest.approx(1.1 * price(step), rel=1e-12)
    assert model.scaled(1.1).fit_error == model.fit_error and model.scaled(1.0) == model
