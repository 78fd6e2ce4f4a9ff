"""The search (orca_jax/tuning/search.py) on synthetic cost models whose best settings are known:
it finds them, agrees with a brute-force scan of rates, and never proposes settings the memory plan
refuses, even where those would be better."""

import dataclasses
import math

import pytest

from orca_jax.config import ConfigError, ParallelConfig, load_model_preset
from orca_jax.parallel.memory_plan import plan_memory
from orca_jax.tuning.cost_model import CostModel
from orca_jax.tuning.search import RATE_RESOLUTION, Space, Target, run_point, search
from orca_jax.tuning.workload import WorkloadSpec, workload_of_spec


def decode_only(intercept: float, per_seq: float) -> CostModel:
    """Every step costs intercept + per_seq x its sequence bucket (attention free)."""
    seqs = [2 ** i for i in range(8)]
    return CostModel({s: intercept + per_seq * s for s in seqs}, 0.0,
                     {t: intercept for t in (1, 4096)}, per_seq, 0.0)


def ample_pages(kv: int) -> int:
    return kv // 1024


def test_the_search_finds_the_known_best_batch_size():
    """One-token prompts and 32-token outputs: a step of S running requests costs 0.02 + 0.01 x S
    (seconds), so throughput grows with the batch, but a TPOT target of 0.065 s allows at most 4 at
    once. The best settings cap the batch at 4 and let the queue absorb bursts; a larger cap admits
    bursts and breaks TPOT at a lower rate, a smaller one saturates earlier; static batching waits
    for whole batches and breaks TTFT first."""
    workload = workload_of_spec(WorkloadSpec(num_requests=100, prompt_dist="equal", prompt_len=(1, 1),
                                             output_dist="equal", output_len=(32, 32), seed=1))
    model = decode_only(0.02, 0.01)
    target = Target(ttft_p99_s=4.0, tpot_p99_s=0.065)
    space = Space(policies=("static", "orca"), max_num_seqs=(1, 2, 4, 8, 16), max_num_batched_tokens=(16,),
                  kv_cache_memory=(1 << 20,))
    winner, outcomes, refused = search(space, workload, model, target, ample_pages, page_size=16)
    assert (winner.settings.policy, winner.settings.max_num_seqs) == ("orca", 4)
    assert not refused and len(outcomes) == 10
    # A scan of rates over the winner and its neighbours finds no better capacity.
    rates = [0.25 * 1.04 ** i for i in range(60)]
    brute = max(max((r for r in rates if run_point(o.settings, workload, r, model).meets(target)), default=0)
                for o in outcomes if o.settings.policy == "orca" and o.settings.max_num_seqs in (2, 4, 8))
    assert winner.capacity == pytest.approx(brute, rel=0.05)
    assert winner.point.meets(target) and winner.point.rate == winner.capacity
    # The capacity is a real edge: a little above it the target is missed.
    assert not run_point(winner.settings, workload, winner.capacity * 1.1, model).meets(target)


def test_at_a_given_rate_the_search_picks_the_lowest_p99s():
    workload = workload_of_spec(WorkloadSpec(num_requests=100, prompt_len=(1, 1), prompt_dist="equal",
                                             output_dist="uniform", output_len=(8, 32), seed=2))
    model = decode_only(0.02, 0.01)
    target = Target(ttft_p99_s=2.0, tpot_p99_s=0.1, rate=2.0)
    space = Space(policies=("orca",), max_num_seqs=(1, 2, 4, 8, 16), max_num_batched_tokens=(16,),
                  kv_cache_memory=(1 << 20,))
    winner, outcomes, _ = search(space, workload, model, target, ample_pages, page_size=16)
    scores = [run_point(o.settings, workload, 2.0, model).score(target) for o in outcomes]
    assert winner.point.score(target) == min(scores) and winner.point.rate == 2.0
    assert len(set(scores)) > 1  # the settings differ: the choice is not a tie


TINY = dataclasses.replace(load_model_preset("tiny"), max_position=128)  # 512 bytes of K/V per token


def tiny_plan(device_memory: int):
    def pages(kv: int) -> int:
        return plan_memory(TINY, ParallelConfig(), page_size=16, max_model_len=128, device_memory=device_memory,
                           kv_cache_memory=kv).num_pages
    return pages


def test_settings_the_memory_plan_refuses_are_never_proposed():
    """64-token requests (4 pages of 8 KiB each) and a cost model where batching is nearly free: the
    more KV, the more requests run at once, the higher the capacity. On a 2 MiB device (parameters
    306 KiB, reserve 10%) the plan allows KV budgets up to 1 MiB: the larger ones, which would win,
    are refused and never simulated; so is one too small for a single 128-token sequence."""
    workload = workload_of_spec(WorkloadSpec(num_requests=200, prompt_dist="equal", prompt_len=(24, 24),
                                             output_dist="equal", output_len=(40, 40), seed=3))
    model = decode_only(0.02, 0.0002)
    target = Target(ttft_p99_s=1.5, tpot_p99_s=0.05)
    kv_budgets = (32 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20)
    space = Space(policies=("orca", "paged"), max_num_seqs=(16, 64), max_num_batched_tokens=(256,),
                  kv_cache_memory=kv_budgets)

    winner, outcomes, refused = search(space, workload, model, target, tiny_plan(2 << 20), page_size=16)
    for outcome in outcomes:  # each one the plan accepts
        tiny_plan(2 << 20)(outcome.settings.kv_cache_memory)
    assert {o.settings.kv_cache_memory for o in outcomes} == {256 << 10, 1 << 20}
    assert sorted(what for what, _ in refused) == ["kv=0.03125MiB", "kv=2MiB", "kv=4MiB"]
    assert all("memory plan" in why for _, why in refused)
    for kv in (32 << 10, 2 << 20, 4 << 20):
        with pytest.raises(ConfigError):
            tiny_plan(2 << 20)(kv)
    assert winner.settings.kv_cache_memory == 1 << 20

    # With room for them, the larger budgets are tried and one of them wins: the bound made the difference.
    roomy, _, _ = search(space, workload, model, target, tiny_plan(16 << 20), page_size=16)
    assert roomy.settings.kv_cache_memory >= 2 << 20 and roomy.capacity > winner.capacity * 1.2


def test_a_request_longer_than_the_kv_cache_or_a_prompt_over_the_budget_is_refused_by_name():
    workload = workload_of_spec(WorkloadSpec(num_requests=5, prompt_dist="equal", prompt_len=(100, 100),
                                             output_dist="equal", output_len=(60, 60)))
    space = Space(policies=("orca", "chunked"), max_num_seqs=(4,), max_num_batched_tokens=(64,),
                  kv_cache_memory=(8 << 10, 1 << 20))
    winner, outcomes, refused = search(space, workload, decode_only(0.01, 0.001), Target(10.0, 1.0),
                                       ample_pages, page_size=16)
    reasons = dict(refused)
    assert "less than the workload's longest request (160)" in reasons["kv=0.0078125MiB"]
    assert "does not split prompts, and the longest prompt (100 tokens) exceeds the token budget" in \
        reasons["orca seqs=4 tokens=64"]
    assert [o.settings.label for o in outcomes] == ["chunked seqs=4 tokens=64 kv=1MiB"]
    assert winner is outcomes[0] and math.isfinite(winner.capacity)


def test_at_the_capacity_the_ttft_tail_moves_more_than_the_step_cost():
    """The verifying run is at the capacity, where queueing starts: 5% dearer steps lengthen the
    simulated TTFT p99 by more than 5%, and 5% cheaper ones shorten it; the report gives both."""
    from orca_jax.tuning.search import sensitivity

    workload = workload_of_spec(WorkloadSpec(num_requests=100, prompt_dist="equal", prompt_len=(1, 1),
                                             output_dist="equal", output_len=(32, 32), arrival="poisson", seed=1))
    model = decode_only(0.02, 0.01)
    target = Target(ttft_p99_s=4.0, tpot_p99_s=0.065)
    space = Space(policies=("orca",), max_num_seqs=(4,), max_num_batched_tokens=(16,), kv_cache_memory=(1 << 20,))
    winner, _, _ = search(space, workload, model, target, ample_pages, page_size=16)
    around = sensitivity(winner.settings, workload, winner.capacity, model, error=0.05)
    at = winner.point
    assert around["0.95"]["ttft_p99_s"] < at.ttft_p99_s < around["1.05"]["ttft_p99_s"]
    assert around["1.05"]["ttft_p99_s"] > 1.05 * at.ttft_p99_s
    assert around["0.95"]["tpot_p99_s"] < at.tpot_p99_s < around["1.05"]["tpot_p99_s"]


def test_a_runs_iteration_count_tells_its_speed():
    """Steps dearer than measured batch more tokens each, so fewer of them: the simulation at the
    scale speed_of_run finds runs as many iterations as a run whose steps all cost 1.15x."""
    from orca_jax.tuning.search import Settings, simulate_at, speed_of_run

    workload = workload_of_spec(WorkloadSpec(num_requests=100, prompt_dist="uniform", prompt_len=(8, 64),
                                             output_dist="uniform", output_len=(8, 64), arrival="poisson", seed=1))
    model = decode_only(0.02, 0.01)
    settings = Settings("chunked", 8, 64, 1 << 20, ample_pages(1 << 20), 16)
    slower = simulate_at(settings, workload, 2.0, model.scaled(1.15))
    assert simulate_at(settings, workload, 2.0, model).num_steps > slower.num_steps + 100  # the premise
    assert speed_of_run(settings, workload, 2.0, model, slower.num_steps) == pytest.approx(1.15, rel=0.02)
    # A count no scale in [0.5, 2] gives is not named as the nearest bound.
    assert speed_of_run(settings, workload, 2.0, model, 1) is None
    assert speed_of_run(settings, workload, 2.0, model, 10**9) is None


def mixed_costs() -> CostModel:
    """Every kind of term at work: prompt and decode attention, per-sequence and host costs."""
    return CostModel({s: 0.01 + 0.002 * s for s in (1, 2, 4, 8, 16)}, 0.003,
                     {t: 0.01 + 0.0004 * t for t in (16, 32, 64, 128, 256)}, 0.0005, 0.0008,
                     host_s_per_step=0.002, host_s_per_seq=0.0002, prefill_per_1k_decode_attended_s=0.003)


def test_a_cost_margin_lowers_the_rate_by_the_expected_amount():
    """Every step k times dearer is every time k times longer: the search with the margin runs the
    search at the nominal costs under targets 1 / k as long with every rate divided by k (the same
    decisions, scaled), so its capacities are those / k, below the nominal capacity / k. At the
    recommended rate the nominal costs predict p99s under the target."""
    workload = workload_of_spec(WorkloadSpec(num_requests=120, prompt_dist="zipf", prompt_len=(8, 200),
                                             output_dist="zipf", output_len=(4, 64), arrival="poisson", seed=4))
    model, k = mixed_costs(), 1.1
    target = Target(ttft_p99_s=0.3, tpot_p99_s=0.06)  # the TTFT tail binds: queueing, not saturation
    space = Space(policies=("chunked", "orca"), max_num_seqs=(4, 8, 16), max_num_batched_tokens=(64, 256),
                  kv_cache_memory=(1 << 20,))
    nominal, _, _ = search(space, workload, model, target, ample_pages, page_size=16)
    winner, outcomes, _ = search(space, workload, model.scaled(k), target, ample_pages, page_size=16)
    tight, tight_outcomes, _ = search(space, workload, model, Target(target.ttft_p99_s / k, target.tpot_p99_s / k),
                                      ample_pages, page_size=16)
    assert winner.settings == tight.settings and len({o.capacity for o in outcomes}) > 3
    for o, t in zip(outcomes, tight_outcomes):  # each candidate's capacity, not only the winner's
        assert o.capacity == pytest.approx(t.capacity / k, rel=1e-9), o.settings.label
    recommended = winner.capacity
    # The TTFT tail is steeper than the rate: more than 1 / k off, beyond the bisection's resolution.
    assert recommended < nominal.capacity / k / (1 + RATE_RESOLUTION)
    at = run_point(winner.settings, workload, recommended, model)
    assert at.meets(target) and at.ttft_p99_s < winner.point.ttft_p99_s
    assert run_point(winner.settings, workload, recommended, model.scaled(k)).meets(target)


def test_settings_round_trip_through_a_reports_json():
    """bench_tune.py and ttft_breakdown.py read a report's settings back with from_json."""
    from orca_jax.tuning.search import Settings

    settings = Settings("chunked", 64, 128, 512 << 20, 728, 16)
    assert Settings.from_json(settings.to_json()) == settings
    assert settings.to_json()["num_kv_pages"] == 728  # the report's key, as bench_tune reads it
