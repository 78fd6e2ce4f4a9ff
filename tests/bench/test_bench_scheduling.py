"""The scheduling bench's measuring parts on the trained tiny model: every policy through one shared
runner, iterations equal to the simulation's, latencies from the engine's own clock, the step-time
model measured without a recompile, plots small enough to commit."""

import random

import pytest
from workloads import WorkloadRequest

from orca_jax.config import REPO_ROOT
from orca_jax.tuning.simulate import POLICIES, SimConfig, simulate


@pytest.fixture(scope="module")
def tiny_llm():
    from orca_jax import LLM

    return LLM(REPO_ROOT / "checkpoints" / "tiny", max_num_seqs=8, max_num_batched_tokens=64, show_progress=False)


def test_policies_through_one_runner_match_the_simulation(tiny_llm, tmp_path):
    import bench_scheduling as bench

    model, curves = bench.measure_step_times(tiny_llm.runner, 8, (16, 100))
    assert set(model.base) == set(tiny_llm.runner.buckets.pairs())
    assert curves["decode_batch_sizes"] == [1, 2, 4, 8]
    rng = random.Random(0)
    workload = [WorkloadRequest([rng.randrange(3, 60) for _ in range(rng.randint(5, 60))], rng.randint(1, 40))
                for _ in range(20)]
    lengths = [(len(r.prompt_token_ids), r.max_tokens) for r in workload]
    rows = {}
    for policy in POLICIES:
        row = bench.run_policy(tiny_llm, policy, workload, 8, 64)
        sim = simulate(lengths, SimConfig(policy, 8, 64, tiny_llm.runner.page_size, tiny_llm.runner.num_pages))
        assert row["steps"] == sim.num_steps
        assert row["generated_tokens"] == sum(r.max_tokens for r in workload)
        bench.add_prediction(row, sim if policy != "static" else None, model)  # static: as if not modelled
        for name in ("ttft_s", "tbt_s", "e2e_latency_s", "normalised_latency_s_per_token"):
            q = row[name]
            assert 0 <= q["p50"] <= q["p90"] <= q["p99"]
        rows[policy] = row
    # Static keeps finished members as padding rows and releases a batch only when it completes, so
    # a request's result comes out no earlier than its batch's last token.
    assert rows["static"]["wasted_decode_slots"] > 0
    assert all(rows[p]["wasted_decode_slots"] == 0 for p in ("orca", "paged", "chunked"))
    assert rows["static"]["steps"] > rows["orca"]["steps"]
    assert tiny_llm.num_compilations_after_warmup == 0  # measuring used the compiled buckets only

    assert rows["orca"]["simulated_steps"] == rows["orca"]["steps"] and rows["orca"]["predicted_wall_s"] > 0
    per_bucket = rows["orca"]["per_bucket"]
    assert sum(b["steps"] for b in per_bucket.values()) == rows["orca"]["steps"]
    assert sum(b["model_s"] for b in per_bucket.values()) == pytest.approx(rows["orca"]["predicted_wall_s"])
    assert rows["static"]["predicted_tokens_per_s"] is None
    workloads = [{"kind": "tiny", "policies": list(rows.values())}]
    bench.plot_step_times(curves, "tiny", tmp_path / "step.png")
    bench.plot_policies(workloads, tmp_path / "policies.png")
    for png in ("step.png", "policies.png"):
        assert 1_000 < (tmp_path / png).stat().st_size < 150_000
