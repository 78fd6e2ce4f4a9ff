"""`--load-format dummy`: seeded random weights made on the devices, equal whatever the layout, so a
dummy model's greedy tokens are the same at 1x1, tp 2 and pp 2 (and over two processes:
test_multihost.py); the same seed gives the same weights, another seed others."""

import numpy as np
import pytest
from flax import nnx

from orca_jax.checkpoint.dummy import DummyWeights
from orca_jax.checkpoint.store import stage_parameter_name
from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig, load_model_preset
from orca_jax.engine.step_plan import Buckets
from orca_jax.engine_args import config_from_keywords
from orca_jax.model.decoder import abstract_decoder
from orca_jax.runner.builder import BuildOptions, build_engine
from orca_jax.runner.model_runner import ModelRunner
from orca_jax.sampling_params import SamplingParams

from ..engine.conftest import run_all

TINY = load_model_preset("tiny")
PROMPTS = [[64, 3, 9, 27], [5], [64, 10, 11, 12, 13, 14, 15], [40, 2]]


def dummy_runner(tp=1, pp=1, seed=0):
    # XLA's dot in every layout: the native matmuls' transposed rows (tp 1 only) would hold the same
    # weights in another shape, and the layouts are compared array for array.
    settings = config_from_keywords(page_size=4, attention_impl="xla", tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp, matmul_impl="xla")
    runner = ModelRunner(abstract_decoder(TINY), settings, num_pages=64, max_model_len=128,
                         buckets=Buckets(tokens=(16,), seqs=(4,)), weights=DummyWeights(seed))
    runner.warm_up(show_progress=False)
    return runner


def whole(runner) -> dict[str, np.ndarray]:
    """Every parameter of every stage, gathered to the host, by its name in the whole model."""

    params = {}
    for stage in runner.stages:
        for path, value in nnx.to_flat_state(stage.params):
            params[stage_parameter_name(path, stage.layers, TINY.tie_word_embeddings)] = np.asarray(value.get_value())
    return params


@pytest.fixture(scope="module")
def one_device():
    return dummy_runner()


def greedy_tokens(runner):
    from orca_jax.engine.engine import LLMEngine

    config = EngineConfig(model="tiny", cache=CacheConfig(page_size=4),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))
    engine = LLMEngine(config, TINY, runner, None, max_model_len=128)
    return [o.outputs[0].token_ids for o in run_all(engine, [(p, SamplingParams(temperature=0, max_tokens=8)) for p in PROMPTS])]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_dummy_weights_and_greedy_tokens_are_the_same_in_every_layout(one_device, tp, pp):
    runner = dummy_runner(tp, pp)
    assert whole(runner).keys() == whole(one_device).keys()
    for name, value in whole(runner).items():
        np.testing.assert_array_equal(value, whole(one_device)[name], err_msg=name)
    tokens = greedy_tokens(runner)
    assert tokens == greedy_tokens(one_device)
    # The layers matter: not a model that repeats the prompt's last token, nor a constant one.
    assert len({t for row in tokens for t in row}) > 4
    assert any(row != [prompt[-1]] * len(row) for row, prompt in zip(tokens, PROMPTS))


def test_each_device_makes_only_its_own_shard():
    stage = dummy_runner(tp=2).stages[0]
    q = stage.params["layers"][0]["attn"]["q"]["kernel"][...]  # [D, H, Dh]: 4 heads, 2 per device
    assert {shard.data.shape[1] for shard in q.addressable_shards} == {2}
    assert len({shard.device for shard in q.addressable_shards}) == 2


def test_the_same_seed_gives_the_same_weights_another_seed_others(one_device):
    again, other = whole(dummy_runner(seed=0)), whole(dummy_runner(seed=1))
    reference = whole(one_device)
    for name, value in reference.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    kernels = [n for n in reference if n.endswith("kernel") or n.endswith("embedding")]
    assert kernels and all(not np.array_equal(other[n], reference[n]) for n in kernels)
    # Each parameter draws from its own key: no two matrices of one shape are equal.
    assert not np.array_equal(reference["layers.0.attn.q.kernel"], reference["layers.1.attn.q.kernel"])
    assert reference["layers.0.attn_norm.scale"].tolist() == [1.0] * TINY.d_model


def test_a_dummy_engine_builds_from_a_preset_without_a_checkpoint(capfd):
    config = EngineConfig(model="tiny-gpt", load_format="dummy", max_model_len=64,
                          cache=CacheConfig(page_size=16, kv_cache_memory=1 << 22),
                          scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16))
    engine = build_engine(config, BuildOptions(token_buckets=(16,), seq_buckets=(2,)))
    assert engine.tokenizer is None
    assert "weights of tiny-gpt are RANDOM (seed 0)" in capfd.readouterr().err
    (output,) = run_all(engine, [([1, 45, 7], SamplingParams(temperature=0, max_tokens=3))])
    assert len(output.outputs[0].token_ids) == 3
    assert all(0 <= t < 66 for t in output.outputs[0].token_ids)
