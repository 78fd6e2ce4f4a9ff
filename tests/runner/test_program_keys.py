"""A stored program is loaded only for the matrix layouts it was compiled for: two GGUF block
types can give arrays of one shape (Q5_0 and Q5_K rows are both 22 bytes per 32 weights), and a
program compiled for one would read the other's bytes wrongly."""

import dataclasses
from pathlib import Path

import jax

from orca_jax.checkpoint.store import LoadedModel
from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig, load_model_preset
from orca_jax.model.decoder import init_decoder
from orca_jax.model.linear import FloatLinear, GGUFBlockLinear
from orca_jax.runner.builder import BuildOptions, build_runner
from orca_jax.runner.compile_cache import ExecutableStore

# The tiny preset widened to one K-quant block (256 weights) per row of the MLP's down projection.
CONFIG = dataclasses.replace(load_model_preset("tiny"), d_model=256, d_ff=256, n_layers=1)


def runner_with_down_as(block_type: str, store: Path):
    def linear(path: str):
        return GGUFBlockLinear(block_type, cpu_native=False) if path == "layers.0.mlp.down" else FloatLinear()

    loaded = LoadedModel(CONFIG, init_decoder(CONFIG, seed=0, linear=linear), None, Path("in-memory"))
    engine = EngineConfig(model="in-memory", max_model_len=32, cache=CacheConfig(page_size=4, kv_cache_memory=1 << 20),
                          scheduler=SchedulerConfig(policy="orca", max_num_seqs=2, max_num_batched_tokens=4))
    runner, _, _ = build_runner(engine, BuildOptions(token_buckets=[4], seq_buckets=[2], show_progress=False), loaded)
    runner.executable_store = ExecutableStore(store)
    runner.compile_programs()
    return runner


def test_a_program_stored_for_one_block_type_is_not_loaded_for_another_of_the_same_shapes(tmp_path):
    q5_0 = runner_with_down_as("Q5_0", tmp_path)
    assert q5_0.executable_store.loaded == 0
    q5_k = runner_with_down_as("Q5_K", tmp_path)
    shapes = lambda runner: [(a.shape, a.dtype) for a in jax.tree.leaves(runner.stages[0].params)]  # noqa: E731
    assert shapes(q5_0) == shapes(q5_k)  # the premise: the two layouts' arrays are alike
    assert q5_k.executable_store.loaded == 0  # compiled for its own layout
    assert runner_with_down_as("Q5_0", tmp_path).executable_store.loaded == 2  # the store still works
