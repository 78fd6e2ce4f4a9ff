"""Our GGUFReader (arrays read whole) hands out the fields and tensors gguf's own reader does."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGUFValueType

from orca_jax.checkpoint.gguf_import import GGUF_FILE
from orca_jax.checkpoint.gguf_reader import GGUFReader


def assert_same_as_ggufs(path) -> None:
    ours, theirs = GGUFReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, want in theirs.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.types, len(got.data)) == (want.offset, want.types, len(want.data)), name
        assert got.contents() == want.contents(), name
        if want.types[0] == GGUFValueType.ARRAY:  # one element at a time too, every one
            assert [got.contents(i) for i in range(len(want.data))] == [want.contents(i) for i in range(len(want.data))]
    assert len(ours.tensors) == len(theirs.tensors)
    for got, want in zip(ours.tensors, theirs.tensors):
        assert (got.name, got.tensor_type, list(got.shape), got.data_offset) == \
            (want.name, want.tensor_type, list(want.shape), want.data_offset)
        np.testing.assert_array_equal(got.data, want.data)
    assert ours.data_offset == theirs.data_offset


def test_every_kind_of_field_reads_as_ggufs_own(tmp_path):
    path = tmp_path / "fields.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("text", "héllo")
    writer.add_uint32("count", 7)
    writer.add_array("pieces", ["", "a", "▁the", "日本語", "<0x0A>", "x" * 300])  # the empty string, long ones
    for kind, dtype in [(GGUFValueType.UINT8, np.uint8), (GGUFValueType.INT8, np.int8),
                        (GGUFValueType.UINT16, np.uint16), (GGUFValueType.INT16, np.int16),
                        (GGUFValueType.UINT32, np.uint32), (GGUFValueType.INT32, np.int32),
                        (GGUFValueType.UINT64, np.uint64), (GGUFValueType.INT64, np.int64),
                        (GGUFValueType.FLOAT32, np.float32), (GGUFValueType.FLOAT64, np.float64)]:
        writer.add_key_value(f"numbers.{kind.name}", list(np.arange(-3, 5).astype(dtype)), GGUFValueType.ARRAY,
                             sub_type=kind)
    writer.add_array("flags", [True, False, True])
    writer.add_array("nested", [[1, 2], [3]])  # an array of arrays: gguf's own path
    writer.add_tensor("weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_ggufs(path)
    assert GGUFReader(path).fields["pieces"].contents() == ["", "a", "▁the", "日本語", "<0x0A>", "x" * 300]


def test_a_real_files_vocabulary_reads_as_ggufs_own(smollm2):
    """SmolLM2's GGUF: 49,152 pieces, their types and 48,900 merges."""
    assert_same_as_ggufs(smollm2.path / GGUF_FILE)
