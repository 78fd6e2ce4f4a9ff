"""gguf's `GGUFReader`, with a file's metadata arrays read whole.

gguf 0.19's reader walks a metadata array element by element, each through several numpy calls. A
vocabulary is three such arrays (pieces, scores, token types) and often a fourth (merges), so opening
a file takes 2.3 s for SmolLM2's 49,152 pieces and 21 s for Gemma's 262,144, and `--quantization
gguf` opens the file at every start. This reader reads an array of numbers as one view and an array
of strings in one pass over their lengths, and hands out fields of gguf's own shape: one part per
element, `data` indexing each, so `ReaderField.contents()` (whole, or one element) gives what gguf's
fields give. The tensors are gguf's own. Arrays of arrays, empty arrays and byte-swapped files take
gguf's own path. It overrides one internal method of gguf's reader (`_get_field_parts`), so
tests/checkpoint/test_gguf_reader.py holds every field to gguf's own reader: a gguf release that
changes that method fails there.
"""

from __future__ import annotations

import struct

import gguf
import numpy as np
from gguf import GGUFValueType

_LENGTH = struct.Struct("=Q")  # a string's byte count (the file's byte order is the host's: see below)


class GGUFReader(gguf.GGUFReader):
    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_item_type = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        item_type, n = GGUFValueType(int(raw_item_type[0])), int(count[0])
        start = orig_offs + 12
        scalar = self.gguf_scalar_to_np.get(item_type)
        if n == 0 or (scalar is None and item_type != GGUFValueType.STRING):
            return super()._get_field_parts(orig_offs, raw_type)
        parts = [raw_item_type, count]
        if scalar is not None:
            values = self._get(start, scalar, n)
            parts.extend(values.reshape(n, 1))  # one 1-element view per value, as gguf's parts are
            end = start + values.nbytes
        else:
            data, end = self.data.view(np.ndarray), start  # plain views: slicing a memmap costs more
            for _ in range(n):
                (length,) = _LENGTH.unpack_from(data, end)
                end += _LENGTH.size
                parts.append(data[end:end + length])
                end += length
        # gguf's own parts also hold each string's length; only the data parts are indexed, here as there.
        return end - orig_offs, parts, list(range(2, len(parts))), [GGUFValueType.ARRAY, item_type]
