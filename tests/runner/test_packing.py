"""A step's host arrays travel as one buffer per dtype and come back out exactly (packing.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from orca_jax.engine.step_plan import KVLayout, padding_plan
from orca_jax.model.sampler import SamplingMetadata
from orca_jax.runner.step_inputs import HeadInputs, StepInputs
from orca_jax.runner.packing import pack


def _tree():
    rng = np.random.default_rng(0)
    return {
        "ids": rng.integers(-5, 1000, (3, 7)).astype(np.int32),
        "lens": np.arange(5, dtype=np.int32),
        "scale": rng.standard_normal(4).astype(np.float32),
        "flag": np.bool_(True),
        "mask": rng.random((2, 3)) > 0.5,
        "seeds": np.array([1, 2**32 - 1], np.uint32),
        "placed": jnp.arange(6.0),  # already on the device: passed through, not copied into a buffer
        "empty": np.zeros((0, 4), np.int32),
    }


def test_packing_makes_one_buffer_per_dtype_and_unpacks_exactly_inside_jit():
    tree = _tree()
    packed = pack(tree)
    assert sorted(b.dtype.name for b in packed.buffers) == ["bool", "float32", "int32", "uint32"]
    assert len(packed.kept) == 1
    unpacked = jax.jit(lambda p: p.unpack())(jax.device_put(packed))
    assert jax.tree.structure(unpacked) == jax.tree.structure(tree)
    for name, value in tree.items():
        got = np.asarray(unpacked[name])
        assert got.dtype == np.asarray(value).dtype and got.shape == np.shape(value), name
        np.testing.assert_array_equal(got, np.asarray(value), err_msg=name)


def test_a_decode_steps_inputs_reach_the_device_in_one_buffer_per_dtype():
    kv = KVLayout(num_pages=8, page_size=4, max_pages_per_seq=3, max_num_seqs=4)
    plan = padding_plan(1, 1, kv, vocab_size=40)
    inputs = pack(StepInputs.of(plan))
    assert [b.dtype.name for b in inputs.buffers] == ["int32"]  # 7 int32 arrays, one transfer
    assert plan.sampling.token_bitmask is None  # no grammar: the runner passes its own all-ones words
    sampling = HeadInputs(40).sampling(plan, NamedSharding(Mesh(jax.devices()[:1], ("x",)), PartitionSpec()))
    assert len(sampling.buffers) <= 4 and len(sampling.kept) == 3  # ~20 arrays in at most 4 transfers
    back = sampling.unpack()
    np.testing.assert_array_equal(back.stop_ids, plan.sampling.stop_ids)
    np.testing.assert_array_equal(back.token_bitmask, np.full((1, 2), -1, np.int32))  # 40 tokens: 2 words


def test_a_speculating_plans_metadata_reaches_the_device_as_the_same_class():
    """The plan's SpeculationMetadata (numpy, without block tables) is the class the verifier reads
    on the device: the runner adds the plan's block tables, packs it, and the program unpacks it."""
    import dataclasses

    from orca_jax.runner.speculation import SpeculationMetadata
    from orca_jax.runner.step_inputs import HeadInputs

    kv = KVLayout(num_pages=8, page_size=4, max_pages_per_seq=3, max_num_seqs=4, num_speculative_tokens=2)
    plan = padding_plan(4, 6, kv, vocab_size=40)
    host = plan.speculation
    assert type(host) is SpeculationMetadata and host.block_tables is None
    host.row_draft[:2] = [5, 6]
    packed = HeadInputs.speculation(plan)  # the runner's own packing, block tables added
    device = jax.jit(lambda p: p.unpack())(jax.device_put(packed))
    assert type(device) is SpeculationMetadata
    for field in dataclasses.fields(SpeculationMetadata):
        want = plan.block_tables if field.name == "block_tables" else getattr(host, field.name)
        np.testing.assert_array_equal(np.asarray(getattr(device, field.name)), want, err_msg=field.name)
