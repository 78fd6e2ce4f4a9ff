"""Sharded loading: the engine restores each stage's parameters from the checkpoint straight into
their shardings, so at tp 3 every device receives only its shard of SmolLM2's sharded parameters
(no device ever holds one whole), with the values of the whole-model load."""

import jax
import numpy as np

from orca_jax.checkpoint.store import CheckpointWeights, open_model
from orca_jax.engine.step_plan import Buckets
from orca_jax.engine_args import config_from_keywords
from orca_jax.runner.model_runner import ModelRunner

from ..conftest import SMOLLM2


def test_loading_at_tp3_gives_each_device_only_its_shards(smollm2, monkeypatch):
    opened = open_model(SMOLLM2)
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(jax.tree.map(
        lambda x: x, opened.model.embed.embedding.get_value())))  # nothing read yet
    placed = []  # the shape of every array put on a device while the runner loads

    def spy_put(x, *args, **kwargs):
        placed.append(tuple(np.shape(x)))
        return real_put(x, *args, **kwargs)

    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", spy_put)
    weights = CheckpointWeights(opened.path)
    settings = config_from_keywords(page_size=16, attention_impl="xla", tensor_parallel_size=3)
    runner = ModelRunner(opened.model, settings, num_pages=8, max_model_len=64,
                         buckets=Buckets(tokens=(8,), seqs=(2,)), weights=weights)
    monkeypatch.undo()
    stage = runner.stages[0]
    embedding = stage.params["embed"]["embedding"][...]  # [V, D]: 49152 rows, 16384 per device
    assert [s.data.shape for s in embedding.addressable_shards] == [(16384, 576)] * 3
    q = stage.params["layers"][7]["attn"]["q"]["kernel"][...]  # [D, H, Dh]: 9 heads, 3 per device
    assert [s.data.shape for s in q.addressable_shards] == [(576, 3, 64)] * 3
    leaves = jax.tree.leaves(stage.params)
    sharded = {tuple(leaf.shape) for leaf in leaves if not leaf.sharding.is_fully_replicated}
    # A whole K projection [576, 3, 64] has the shape of a Q projection's shard: not telling.
    shard_shapes = {tuple(s.data.shape) for leaf in leaves for s in leaf.addressable_shards}
    assert {(49152, 576), (576, 9, 64), (576, 1536)} <= sharded - shard_shapes and placed  # the spy saw the load
    assert not (sharded - shard_shapes) & set(placed), "a device received a whole sharded parameter"
    assert weights.read.keys() == {f"layers.{i}.{p}" for i in range(30) for p in (
        "attn_norm.scale", "attn.q.kernel", "attn.k.kernel", "attn.v.kernel", "attn.o.kernel", "mlp_norm.scale",
        "mlp.gate.kernel", "mlp.up.kernel", "mlp.down.kernel")} | {"embed.embedding", "final_norm.scale"}
    whole = smollm2.model
    np.testing.assert_array_equal(np.asarray(q), np.asarray(whole.layers[7].attn.q.kernel.get_value()))
    np.testing.assert_array_equal(np.asarray(embedding), np.asarray(whole.embed.embedding.get_value()))
