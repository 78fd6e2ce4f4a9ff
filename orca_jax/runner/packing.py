"""A step's many small host arrays sent to the device as one buffer per dtype.

A decode step's inputs are ~30 small numpy arrays (token ids, positions, slots, block tables, the
sampling parameters...). `jax.device_put` costs about 0.1 ms of host time per array (jax 0.10 on
the Zen 3: ~0.14 ms even for one 100-element array), and a compiled call flattens and checks every
argument, so at batch 1 the host spent more time placing inputs than the device spends on some
layers. `pack` concatenates the numpy leaves of a pytree into one 1-D buffer per dtype (arrays
already on a device pass through untouched). The runner hands the numpy buffers to the compiled
call itself, which places each for ~5 us; `Packed.unpack`, inside the jitted program, slices the
fields back out at offsets fixed at trace time. The layout (which field
sits where) is static pytree data, so a program compiled for one bucket's layout is called only
with that layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every leaf of the packed tree lives: ("packed", buffer, offset, shape) or ("kept", index)."""

    treedef: Any
    slots: tuple[tuple, ...]


@jax.tree_util.register_pytree_node_class
class Packed:
    """The pytree's numpy leaves as `buffers` (one per dtype) and its device arrays as `kept`."""

    def __init__(self, buffers: tuple, kept: tuple, layout: Layout):
        self.buffers, self.kept, self.layout = buffers, kept, layout

    def tree_flatten(self):
        return (self.buffers, self.kept), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Layout, children):
        return cls(*children, layout)

    def unpack(self):
        """The original pytree (inside a jitted program: slices of the placed buffers)."""
        leaves = []
        for slot in self.layout.slots:
            if slot[0] == "kept":
                leaves.append(self.kept[slot[1]])
            else:
                _, buffer, offset, shape = slot
                size = int(np.prod(shape, dtype=np.int64))
                leaves.append(self.buffers[buffer][offset:offset + size].reshape(shape))
        return jax.tree.unflatten(self.layout.treedef, leaves)


def pack(tree) -> Packed:
    """`tree`'s numpy leaves (arrays and numpy scalars) concatenated per dtype; other leaves (jax
    arrays, already placed) kept as they are."""
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[np.dtype, list[np.ndarray]] = {}
    offsets: dict[np.dtype, int] = {}
    kept, slots = [], []
    for leaf in leaves:
        if isinstance(leaf, (np.ndarray, np.generic)):
            value = np.asarray(leaf)
            group = groups.setdefault(value.dtype, [])
            slots.append(("packed", value.dtype, offsets.get(value.dtype, 0), value.shape))
            offsets[value.dtype] = offsets.get(value.dtype, 0) + value.size
            group.append(value.reshape(-1))
        else:
            slots.append(("kept", len(kept)))
            kept.append(leaf)
    dtypes = list(groups)
    index = {dtype: i for i, dtype in enumerate(dtypes)}
    slots = tuple(slot if slot[0] == "kept" else ("packed", index[slot[1]], slot[2], slot[3]) for slot in slots)
    buffers = tuple(np.concatenate(groups[dtype]) for dtype in dtypes)
    return Packed(buffers, tuple(kept), Layout(treedef, slots))
