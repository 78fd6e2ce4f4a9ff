"""Block sizes of the Pallas attention kernels, their defaults per shape, and the shapes Triton takes.

Two kernels serve one call (ragged_paged_attention.py): the query-block kernel, a grid over
(blocks of `block_q` tokens, KV heads), for the rows of prefill chunks; and the decode kernel
(decode_kernel.py), a grid over (sequences, KV heads), for the sequences that have one token in the
call. Each has its own Triton knobs: `num_warps` (threads per program / 32) and `num_stages`
(how many page loads a program keeps in flight: deeper hides more memory latency, and costs
shared memory, page_size x head_dim x bytes x 2 (K and V) per stage).

Defaults per (head_dim, page_size, dtype), `DEFAULTS` below. They are NOT yet tuned on a GPU (no
GPU has run this code; bench/gpu_check.py times them, bench/gpu_block_sweep.py sweeps them and
prints the rows to put here): the reasoning is that decode is bound by reading pages, so small
pages (16 tokens: 2-4 KiB per load) get deeper pipelines than 32-token pages, float32 (twice the
bytes per stage) gets shallower ones, and head_dim 128 gets 8 warps for its wider tiles.

| head_dim | page | dtype | block_q | warps | stages | decode warps | decode stages |
|---|---|---|---|---|---|---|---|
| 64  | 16 | bf16 / f16 | 16 | 4 | 2 | 4 | 4 |
| 64  | 32 | bf16 / f16 | 16 | 4 | 2 | 4 | 3 |
| 128 | 16 | bf16 / f16 | 16 | 8 | 2 | 4 | 4 |
| 128 | 32 | bf16 / f16 | 16 | 8 | 2 | 8 | 3 |
| 64  | 16 | f32 | 16 | 4 | 2 | 4 | 3 |
| 64  | 32 | f32 | 16 | 4 | 2 | 4 | 2 |
| 128 | 16 | f32 | 16 | 8 | 2 | 4 | 3 |
| 128 | 32 | f32 | 16 | 8 | 2 | 8 | 2 |

Other shapes get `BlockSizes()`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Triton's tl.dot needs every dimension of its tiles to be at least 16.
MIN_DOT_DIM = 16


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling and Triton tuning knobs of the two kernels (see the module docstring)."""

    block_q: int = 16  # query tokens per program of the query-block kernel; a power of two, >= 16 compiled
    num_warps: int = 4  # query-block kernel
    num_stages: int = 2
    decode_num_warps: int = 4  # decode kernel
    decode_num_stages: int = 3  # pages in flight per decode program

    def __post_init__(self) -> None:
        if not _is_power_of_two(self.block_q):
            raise ValueError(f"block_q must be a power of two, got {self.block_q}")
        for name in ("num_warps", "decode_num_warps"):
            if not _is_power_of_two(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two (Triton), got {getattr(self, name)}")
        for name in ("num_stages", "decode_num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def _table(rows):
    return {(head_dim, page, itemsize): BlockSizes(block_q=16, num_warps=w, num_stages=st, decode_num_warps=dw,
                                                   decode_num_stages=ds)
            for head_dim, page, itemsize, w, st, dw, ds in rows}


# (head_dim, page_size, bytes per element) -> BlockSizes; the table of the module docstring.
DEFAULTS = _table([
    (64, 16, 2, 4, 2, 4, 4), (64, 32, 2, 4, 2, 4, 3), (128, 16, 2, 8, 2, 4, 4), (128, 32, 2, 8, 2, 8, 3),
    (64, 16, 4, 4, 2, 4, 3), (64, 32, 4, 4, 2, 4, 2), (128, 16, 4, 8, 2, 4, 3), (128, 32, 4, 8, 2, 8, 2),
])


def default_block_sizes(head_dim: int, page_size: int, dtype) -> BlockSizes:
    """The tuned defaults for a shape (module docstring), `BlockSizes()` for one the table lacks."""
    return DEFAULTS.get((head_dim, page_size, np.dtype(dtype).itemsize), BlockSizes())


def check_triton_shapes(*, head_dim: int, page_size: int, block_sizes: BlockSizes) -> None:
    """Refuses, naming the fix, the shapes the compiled (Triton) kernels cannot load: tiles must be
    powers of two, and tl.dot's at least 16 wide. Interpret mode takes any shape."""
    def fail(message: str):
        raise ValueError(f"ragged_paged_attention (Pallas on GPU): {message}")

    if not (_is_power_of_two(page_size) and page_size >= MIN_DOT_DIM):
        fail(f"page_size must be a power of two >= {MIN_DOT_DIM} for Triton's tiles, got {page_size}: "
             "use page_size 16 or 32, or attention_impl='xla'")
    if not (_is_power_of_two(head_dim) and head_dim >= MIN_DOT_DIM):
        fail(f"head_dim must be a power of two >= {MIN_DOT_DIM} for Triton's tiles, got {head_dim}: "
             "this model needs attention_impl='xla'")
    if block_sizes.block_q < MIN_DOT_DIM:
        fail(f"block_q must be >= {MIN_DOT_DIM} for Triton's tl.dot, got {block_sizes.block_q}")
