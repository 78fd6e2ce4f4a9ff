"""The scheduling simulation (orca_jax/tuning/simulate.py) against the real engine: the same workload must
give the same iterations, step by step, for every policy -- with the mock runner over many seeded
workloads and regimes (milliseconds), and once with the trained tiny model."""

import dataclasses
import random

import pytest
from workloads import WorkloadSpec, sample_lengths

from orca_jax.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    load_model_preset,
)
from orca_jax.engine.engine import LLMEngine
from orca_jax.sampling_params import SamplingParams
from orca_jax.tuning.simulate import (
    POLICIES,
    SimConfig,
    SimStep,
    StepTimeModel,
    ideal_ratio,
    predicted_wall_s,
    simulate,
)

from ..engine.conftest import make_engine as make_tiny_engine
from ..conftest import warm_tiny_runner
from ..engine.mock_runner import MockRunner, record_schedules

VOCAB = 1000
MODEL = dataclasses.replace(load_model_preset("tiny"), vocab_size=VOCAB, eos_token_id=None, max_position=4096)

# (max_num_seqs, max_num_batched_tokens, page_size, num_pages): KV ample; KV tight enough that the
# paged policies preempt; a token budget barely above max_num_seqs; odd page size.
REGIMES = {
    "ample": (8, 256, 16, 400),
    "kv-pressure": (8, 256, 16, 20),
    "small-budget": (8, 12, 4, 400),
    "small-pages": (6, 48, 3, 120),
}


def engine_plans(lengths, policy, max_num_seqs, max_num_batched_tokens, page_size, num_pages, runner=None):
    config = EngineConfig(model="mock", cache=CacheConfig(page_size=page_size),
                          scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs,
                                                    max_num_batched_tokens=max_num_batched_tokens))
    runner = runner or MockRunner(num_pages, page_size, VOCAB, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens)
    engine = LLMEngine(config, MODEL, runner, tokenizer=None)
    schedules = record_schedules(engine)
    rng = random.Random(1)
    for prompt_len, max_tokens in lengths:
        engine.add_request([rng.randrange(VOCAB) for _ in range(prompt_len)],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine, [(p.num_batched_tokens, len(p.scheduled), p.num_padding_seqs) for p in schedules]


def sim_plans(result):
    return [(s.num_tokens, s.num_seqs, s.num_padding_seqs) for s in result.steps]


def lengths_for(seed, regime):
    budget = REGIMES[regime][1]
    max_prompt = min(budget, 40)
    spec = WorkloadSpec(num_requests=24, prompt_dist="uniform", prompt_len=(1, max_prompt),
                        output_dist="zipf" if seed % 2 else "uniform", output_len=(1, 60), seed=seed)
    return sample_lengths(spec)


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_simulation_matches_the_engine_step_by_step(policy, regime, seed):
    lengths = lengths_for(seed, regime)
    engine, plans = engine_plans(lengths, policy, *REGIMES[regime])
    result = simulate(lengths, SimConfig(policy, *REGIMES[regime]))
    assert result.num_steps == engine.num_steps
    assert sim_plans(result) == plans
    assert result.num_preemptions == engine.scheduler.num_preemptions


def test_the_regimes_exercise_preemption_chunking_and_static_padding():
    """Guards the test above against regimes too gentle to test anything."""
    lengths = lengths_for(0, "kv-pressure")
    for policy in ("paged", "chunked"):
        assert simulate(lengths, SimConfig(policy, *REGIMES["kv-pressure"])).num_preemptions > 0
    chunked = simulate(lengths_for(0, "small-budget"), SimConfig("chunked", *REGIMES["small-budget"]))
    assert any(start > 0 and n > 1 for s in chunked.steps for start, n in s.chunks)  # a prompt's later chunk
    static = simulate(lengths, SimConfig("static", *REGIMES["ample"]))
    assert sum(s.num_padding_seqs for s in static.steps) > 0


def test_simulation_matches_the_tiny_model():
    """The real runner (trained tiny model, XLA attention), with KV tight enough that the paged
    policies preempt."""
    from orca_jax.checkpoint.store import load_model
    from orca_jax.config import REPO_ROOT

    tiny = load_model(REPO_ROOT / "checkpoints" / "tiny")
    runner = warm_tiny_runner(tiny, "xla")  # 160 pages of 4 tokens, buckets up to 64 tokens x 8 seqs
    rng = random.Random(1)
    lengths = []
    for _ in range(14):
        prompt_len = rng.randint(16, 60)
        lengths.append((prompt_len, rng.randint(20, 128 - prompt_len)))  # the runner's max_model_len is 128
    preemptions = {}
    for policy in POLICIES:
        # The simulation steps one at a time: with a step planned ahead, pages and slots that a
        # finishing request frees are seen one step later, so admissions can come a step later.
        engine = make_tiny_engine(runner, tiny, policy, max_num_seqs=8, max_num_batched_tokens=64,
                                  async_scheduling=False)
        for prompt_len, max_tokens in lengths:
            engine.add_request([rng.randrange(3, 60) for _ in range(prompt_len)],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        result = simulate(lengths, SimConfig(policy, 8, 64, runner.page_size, runner.num_pages))
        assert result.num_steps == engine.num_steps, policy
        assert result.num_preemptions == engine.scheduler.num_preemptions, policy
        preemptions[policy] = engine.scheduler.num_preemptions
    assert preemptions["paged"] > 0 and preemptions["chunked"] > 0
    assert runner.num_compilations_after_warmup == 0


def test_ideal_ratio_favours_iteration_level_only_when_lengths_differ():
    equal = [(50, 32)] * 32
    skewed = [(50, 128 if i % 8 == 0 else 8) for i in range(32)]
    assert ideal_ratio(equal, 8, 512)["step_ratio"] == pytest.approx(1.0)
    # Static: 4 batches of 8, each 1 prefill step + 127 decodes. Orca: the long ones overlap.
    skewed_ratio = ideal_ratio(skewed, 8, 512)
    assert skewed_ratio["static_steps"] == 4 * 128
    assert skewed_ratio["step_ratio"] > 2


def test_step_time_model_prices_the_bucket_and_the_context_a_step_runs_with():
    model = StepTimeModel(token_buckets=[16, 64], seq_buckets=[4, 8],
                          base={(16, 4): 1.0, (64, 4): 3.0, (64, 8): 4.0, (16, 8): 2.0},
                          block_tokens=10, s_per_row_block=0.001)
    assert model.step_seconds(SimStep(((0, 3),))) == 1.0  # a fresh prompt: nothing cached
    assert model.step_seconds(SimStep(((0, 17), (5, 1)))) == 3.0 + 0.001 * 60 * 1  # 5 cached tokens, in row group 2 (60 rows)
    # Static's padding rows take a token and a row each: 2 decodes + 3 padding rows need 8 rows.
    assert model.step_seconds(SimStep(((40, 1), (9, 1)), num_padding_seqs=3)) == 2.0 + 0.001 * 8 * 4
    # Decodes (first row group: 4 rows) with up to 25 cached tokens, then a 12-token chunk after 30.
    step = SimStep(((25, 1), (3, 1), (30, 12)))
    assert model.step_seconds(step) == pytest.approx(1.0 + 0.001 * (4 * 3 + 12 * 3))
    result = simulate([(10, 3)], SimConfig("orca", 4, 64, 4, 10))
    assert [s.chunks for s in result.steps] == [((0, 10),), ((10, 1),), ((11, 1),)]
    assert predicted_wall_s(result, model) == pytest.approx(3.0 + 0.001 * 4 * (1 + 2))  # 10, 11 cached: 1, 2 blocks
