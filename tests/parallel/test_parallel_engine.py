"""Tensor and pipeline parallelism on CPU devices (six, set in tests/conftest.py): every layout gives
the one-device tokens, greedy and seeded, with no compilation after warm-up; a pipeline reaches its
depth of steps in flight; impossible layouts are refused with the fix."""

import dataclasses

import pytest

from orca_jax.config import CacheConfig, ConfigError, EngineConfig, ParallelConfig, SchedulerConfig
from orca_jax.runner.builder import BuildOptions, build_engine
from orca_jax.sampling_params import SamplingParams

from ..conftest import warm_smollm2_runner, warm_tiny_runner
from ..engine.conftest import SMOLLM2_LIMITS, TINY_LIMITS, make_engine, run_all

POLICIES = ["orca", "chunked"]


def tiny_requests():
    """12 requests for 8 slots, greedy and seeded sampling mixed, prompts of 2..10 tokens."""
    requests = []
    for i in range(12):
        prompt = [64] + [(3 * i + j) % 60 for j in range(1 + i % 9)]
        params = (SamplingParams(temperature=0, max_tokens=6 + i % 7) if i % 2 == 0
                  else SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=6 + i % 7))
        requests.append((prompt, params))
    return requests


@pytest.fixture(scope="module")
def tiny_layouts(tiny_trained):
    runners = {}

    def get(tp, pp, impl="xla"):
        if (tp, pp, impl) not in runners:
            runners[tp, pp, impl] = warm_tiny_runner(tiny_trained, impl, tp=tp, pp=pp)
        return runners[tp, pp, impl]

    return get


@pytest.fixture(scope="module")
def tiny_one_device_tokens(tiny_runner, tiny_trained):
    return {policy: [o.outputs[0].token_ids
                     for o in run_all(make_engine(tiny_runner, tiny_trained, policy, **TINY_LIMITS), tiny_requests())]
            for policy in POLICIES}


# "pallas" is the Pallas kernel in interpret mode on CPU.
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tp,pp,impl", [(2, 1, "xla"), (1, 2, "xla"), (2, 2, "xla"), (2, 2, "pallas"),
                                        (2, 1, "native")])
def test_tiny_layouts_give_the_one_device_tokens(tiny_layouts, tiny_trained, tiny_one_device_tokens, policy, tp, pp,
                                                 impl):
    runner = tiny_layouts(tp, pp, impl)
    assert len(runner.stages) == pp and all(stage.mesh.size == tp for stage in runner.stages)
    engine = make_engine(runner, tiny_trained, policy, **TINY_LIMITS)
    outputs = run_all(engine, tiny_requests())
    assert [o.outputs[0].token_ids for o in outputs] == tiny_one_device_tokens[policy]
    # the pipeline filled up; one stage keeps a step planned ahead in flight (async scheduling)
    assert max(engine.in_flight.depths) == (pp if pp > 1 else 2)
    assert runner.num_compilations_after_warmup == 0


def test_parameters_and_kv_pages_are_split_over_tp(tiny_layouts):
    stage = tiny_layouts(2, 1).stages[0]
    k_pages = stage.kv_cache.k[0]  # [L * P, page, K, Dh]: 2 KV heads, one per device
    assert {shard.data.shape[2] for shard in k_pages.addressable_shards} == {1}
    q_kernel = stage.params["layers"][0]["attn"]["q"]["kernel"][...]  # [D, H, Dh]: 4 heads, 2 per device
    assert {shard.data.shape[1] for shard in q_kernel.addressable_shards} == {2}
    embedding = stage.params["embed"]["embedding"][...]  # [V, D]: vocabulary 66, 33 per device
    assert {shard.data.shape[0] for shard in embedding.addressable_shards} == {33}


def test_pipeline_stages_hold_only_their_own_layers(tiny_layouts):
    first, last = tiny_layouts(1, 2).stages
    assert (list(first.layers), list(last.layers)) == ([0], [1])
    assert "embed" in first.params and "head" not in first.params and first.kv_cache.num_layers == 1
    assert "head" in last.params and "embed" not in last.params and last.kv_cache.num_layers == 1
    assert first.mesh.devices.flat[0] != last.mesh.devices.flat[0]


def test_abort_with_steps_in_flight_frees_every_page(tiny_layouts, tiny_trained):
    engine = make_engine(tiny_layouts(1, 2), tiny_trained, "chunked", **TINY_LIMITS)
    ids = [engine.add_request(prompt, params) for prompt, params in tiny_requests()]
    while not engine.in_flight:  # between steps, a full pipeline of depth 2 holds one step in flight
        engine.step()
    victim = engine.in_flight[0][0].scheduled[0].request.request_id
    engine.abort(victim)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_pages == engine.kv.num_pages and victim in ids


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    """2 KV heads for 4 query heads at tp 4: each device holds a copy of the KV head its query head
    reads (copied at load), and the tokens are the one-device tokens."""
    import dataclasses
    import types

    from orca_jax.config import load_model_preset
    from orca_jax.model.decoder import init_decoder

    config = dataclasses.replace(load_model_preset("tiny"), name="tiny-gqa", vocab_size=64, bos_token_id=None,
                                 eos_token_id=None)  # a vocabulary tp 4 divides
    model = types.SimpleNamespace(config=config, model=init_decoder(config, seed=3), tokenizer=None, path="tiny-gqa")
    one, four = (warm_tiny_runner(model, "xla", tp=tp) for tp in (1, 4))
    k_pages = four.stages[0].kv_cache.k[0]
    assert k_pages.shape[2] == 4 and {s.data.shape[2] for s in k_pages.addressable_shards} == {1}
    requests = [([i, i + 1, i + 2], SamplingParams(temperature=0, max_tokens=10)) for i in range(1, 7)]
    tokens = [[o.outputs[0].token_ids for o in run_all(make_engine(runner, model, "chunked", **TINY_LIMITS), requests)]
              for runner in (one, four)]
    assert tokens[0] == tokens[1]


# ---- SmolLM2: tp 3 (its 9 query / 3 KV heads), pp 2, and both -------------------------------------

@pytest.fixture(scope="module")
def smollm2_requests(smollm2, smollm2_reference):
    """The reference cases (greedy, their full length) plus seeded samples of the same prompts."""
    cases = smollm2_reference["cases"]
    greedy = [(c["prompt_ids"], SamplingParams(temperature=0, max_tokens=len(c["greedy_ids"]))) for c in cases]
    seeded = [(c["prompt_ids"], SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12))
              for i, c in enumerate(cases)]
    return greedy + seeded


@pytest.fixture(scope="module")
def smollm2_one_device_tokens(smollm2, smollm2_runner, smollm2_requests):
    engine = make_engine(smollm2_runner, smollm2, "chunked", **SMOLLM2_LIMITS)
    return [o.outputs[0].token_ids for o in run_all(engine, smollm2_requests)]


@pytest.fixture(scope="module")
def smollm2_layouts(smollm2, smollm2_tp3_runner):
    runners = {(3, 1): smollm2_tp3_runner}

    def get(tp, pp):
        if (tp, pp) not in runners:
            runners[tp, pp] = warm_smollm2_runner(smollm2, tp=tp, pp=pp)
        return runners[tp, pp]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 2), (3, 2)])
def test_smollm2_layouts_give_the_one_device_tokens(smollm2, smollm2_layouts, smollm2_reference, smollm2_requests,
                                                    smollm2_one_device_tokens, tp, pp):
    runner = smollm2_layouts(tp, pp)
    for policy in POLICIES:
        engine = make_engine(runner, smollm2, policy, **SMOLLM2_LIMITS)
        tokens = [o.outputs[0].token_ids for o in run_all(engine, smollm2_requests)]
        assert tokens == smollm2_one_device_tokens, policy
        assert tokens[:len(smollm2_reference["cases"])] == [c["greedy_ids"] for c in smollm2_reference["cases"]]
        assert max(engine.in_flight.depths) == (pp if pp > 1 else 2)  # as above
    assert runner.num_compilations_after_warmup == 0


# ---- refusals ------------------------------------------------------------------------------------

def engine_config(loaded, tp=1, pp=1, kv_cache_memory=1 << 20):
    return EngineConfig(model=str(loaded.path), cache=CacheConfig(page_size=4, kv_cache_memory=kv_cache_memory),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
                        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))


def test_an_indivisible_tp_is_refused_naming_the_sizes_that_work(tiny_trained):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3.*n_heads=4 is not divisible by 3.*tp 1 or 2"):
        build_engine(engine_config(tiny_trained, tp=3), loaded=tiny_trained)


def test_more_devices_than_visible_is_refused_naming_the_fix(tiny_trained):
    import jax

    with pytest.raises(ConfigError, match=r"2 x 2 = 4 devices, but only 3 cpu device\(s\) are visible.*"
                                          r"JAX_NUM_CPU_DEVICES=4"):
        build_engine(engine_config(tiny_trained, tp=2, pp=2), loaded=tiny_trained, devices=jax.devices()[:3])


def test_more_stages_than_layers_is_refused(tiny_trained):
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=3 exceeds the model's 2 layers"):
        build_engine(engine_config(tiny_trained, pp=3), loaded=tiny_trained)


def test_a_kv_cache_too_small_for_one_sequence_is_refused_naming_the_shortfall(tiny_trained):
    # A given max_model_len; without one the engine would start with what fits (8 tokens here).
    config = dataclasses.replace(engine_config(tiny_trained, kv_cache_memory=4096), max_model_len=128)
    with pytest.raises(ConfigError, match=r"less than one sequence of max_model_len=128; short by"):
        build_engine(config, BuildOptions(show_progress=False), loaded=tiny_trained)
