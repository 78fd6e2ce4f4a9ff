"""The GPU path lowers, checked on this CPU machine: the tensor-parallel attention (the Pallas kernel
inside shard_map, one shard of heads per device) exported for CUDA runs the Pallas -> Triton
lowering (only the PTX compile needs a GPU), so the sharded GPU path cannot rot unseen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import Mesh

from orca_jax.model.attention import AttentionMetadata
from orca_jax.parallel.tensor_parallel import sharded_paged_attention


@pytest.mark.parametrize("tp", [1, 3])
def test_sharded_pallas_attention_lowers_for_cuda_through_triton(tp):
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    attention = sharded_paged_attention("pallas", mesh)
    tokens, seqs, max_pages, pages, page_size = 64, 8, 16, 64, 16
    heads, kv_heads, head_dim = 9, 3, 64  # SmolLM2
    f32, i32 = jnp.float32, jnp.int32
    shape = jax.ShapeDtypeStruct
    meta = AttentionMetadata(positions=shape((tokens,), i32), segment_ids=shape((tokens,), i32),
                             slot_mapping=shape((tokens,), i32), block_tables=shape((seqs, max_pages), i32),
                             kv_lens=shape((seqs,), i32))
    kv = (shape((pages, page_size, kv_heads, head_dim), f32),) * 2
    exported = export.export(
        jax.jit(lambda q, k, v, kv, meta: attention(q, k, v, kv, meta, sm_scale=0.125)), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(shape((tokens, heads, head_dim), f32), shape((tokens, kv_heads, head_dim), f32),
      shape((tokens, kv_heads, head_dim), f32), kv, meta)
    module = exported.mlir_module()
    assert exported.platforms == ("cuda",) and exported.nr_devices == tp
    assert "__gpu$xla.gpu.triton" in module  # the kernel went through Triton, not Mosaic GPU
