"""The compiled (Triton) path of the Pallas kernels, checked on a CPU host: `jax.export` for CUDA runs
the whole Pallas -> Triton lowering (only the PTX compile needs a GPU), in bfloat16 and float32, at
decode-only, prefill-only and mixed shapes; and the shapes Triton cannot load are refused by name."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

from pallas_kernels import BlockSizes, default_block_sizes, ragged_paged_attention
from pallas_kernels.block_sizes import DEFAULTS

NUM_PAGES, MAX_PAGES = 64, 16
# (tokens T, sequences S) of each kind of step.
STEP_SHAPES = {"decode-only": (64, 64), "prefill-only": (256, 4), "mixed": (128, 16)}
# (head_dim, query heads, KV heads, page_size): head_dim 64 and 128, GQA 4:1 and 8:1, pages 16 and 32.
MODELS = [(64, 16, 4, 16), (128, 32, 4, 32), (128, 32, 8, 16), (64, 64, 8, 32)]


def export_for_cuda(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, page_size, dtype, **kwargs):
    shape, i32 = jax.ShapeDtypeStruct, jnp.int32
    pages = shape((NUM_PAGES, page_size, num_kv_heads, head_dim), dtype)
    attend = jax.jit(lambda *args: ragged_paged_attention(*args, sm_scale=head_dim ** -0.5, **kwargs))
    return export.export(
        attend, platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(shape((num_tokens, num_heads, head_dim), dtype), pages, pages, shape((num_tokens,), i32),
      shape((num_tokens,), i32), shape((num_seqs, MAX_PAGES), i32), shape((num_seqs,), i32))


def triton_kernels(exported) -> dict[str, tuple[int, int]]:
    """Kernel name -> its (grid_x, grid_y), read off the exported module's Triton calls."""
    module = exported.mlir_module()
    grids = [tuple(map(int, g)) for g in re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32", module)]
    names = re.findall(r'name = "(ragged_paged_attention[a-z_]*)"', module)
    assert len(grids) == len(names), (grids, names)
    return dict(zip(names, grids))


@pytest.mark.parametrize("kind", list(STEP_SHAPES))
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads, page_size", MODELS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_both_kernels_lower_for_cuda_through_triton(kind, head_dim, num_heads, num_kv_heads, page_size, dtype):
    num_tokens, num_seqs = STEP_SHAPES[kind]
    exported = export_for_cuda(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, page_size, dtype)
    assert exported.platforms == ("cuda",)
    assert exported.out_avals[0].shape == (num_tokens, num_heads, head_dim)
    assert exported.out_avals[0].dtype == dtype
    # The decode kernel: one program per (sequence, KV head); the query blocks: 16 tokens each.
    assert triton_kernels(exported) == {"ragged_paged_attention_decode": (num_seqs, num_kv_heads),
                                        "ragged_paged_attention": (-(-num_tokens // 16), num_kv_heads)}


@pytest.mark.parametrize("change, message", [
    (dict(page_size=8), "page_size must be a power of two >= 16"),
    (dict(page_size=24), "page_size must be a power of two >= 16"),
    (dict(head_dim=80), "head_dim must be a power of two >= 16"),
    (dict(block_sizes=BlockSizes(block_q=8)), "block_q must be >= 16"),
])
def test_shapes_triton_cannot_load_are_refused_naming_the_fix(change, message):
    settings = dict(num_tokens=32, num_seqs=4, num_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                    dtype=jnp.bfloat16) | change
    with pytest.raises(ValueError, match=message):
        export_for_cuda(**settings)


def test_block_sizes_default_per_head_dim_page_size_and_dtype():
    assert default_block_sizes(128, 16, jnp.bfloat16) == DEFAULTS[128, 16, 2]
    assert default_block_sizes(128, 16, jnp.float16) == DEFAULTS[128, 16, 2]
    assert default_block_sizes(128, 16, jnp.float32) == DEFAULTS[128, 16, 4]
    assert default_block_sizes(128, 16, jnp.float32) != default_block_sizes(128, 16, jnp.bfloat16)
    assert default_block_sizes(256, 64, jnp.bfloat16) == BlockSizes()  # not in the table
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        BlockSizes(num_warps=3)
    with pytest.raises(ValueError, match="decode_num_stages must be at least 1"):
        BlockSizes(decode_num_stages=0)


def test_sliding_window_and_soft_cap_lower_for_cuda_too():
    exported = export_for_cuda(128, 16, 32, 8, 128, 16, jnp.bfloat16, sliding_window=64, soft_cap=30.0)
    assert triton_kernels(exported) == {"ragged_paged_attention_decode": (16, 8), "ragged_paged_attention": (8, 8)}
