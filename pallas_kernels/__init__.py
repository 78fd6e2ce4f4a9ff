"""Pallas attention kernels for orca_jax.

`ragged_paged_attention` is the kernel of the contract (docs/design.md, "The kernel contract"): one
call serves decode tokens, prefill chunks and both mixed, reading K/V from the paged cache and keeping
requests apart by segment id. `ragged_paged_attention_reference` is the same contract in plain jnp.
"""

from pallas_kernels.block_sizes import BlockSizes, default_block_sizes
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = ["BlockSizes", "default_block_sizes", "ragged_paged_attention", "ragged_paged_attention_reference"]
