"""A StepPlan as bytes for the followers (multi-host), and back, without pickle.

A follower needs only the plan's arrays (the request ids and sampled rows are the leader's
bookkeeping), so the encoding is a small JSON header naming each array's field, dtype and shape,
followed by the arrays' raw bytes in that order. The [S, N] tables whose right-hand columns are
mostly padding (block tables beyond the longest sequence's pages, an unused token bitmask or logit
bias) are sent only up to their last column that differs from the padding value and filled back in
on decoding: a decode step of SmolLM2's default engine is then a few KB instead of ~340 KB, which
matters because the coordination service's key-value store costs ~10 us per KB (bench/results/HISTORY.md, Multi-host plan channel). Decoding accepts only the known fields and plain
numeric dtypes and checks every length: a message that is not an encoded plan raises ValueError, and
nothing in it is ever run or imported.

Pure numpy, no jax: the leader encodes on the engine thread.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np

from orca_jax.engine.step_plan import StepPlan
from orca_jax.step_metadata import SamplingMetadata, SpeculationMetadata

_MAGIC = b"ORCAPLAN1"
_HEADER_LENGTH = struct.Struct("!I")
_DTYPES = frozenset({"int32", "uint32", "float32", "bool"})
_PLAN_ARRAYS = ("token_ids", "token_source", "positions", "segment_ids", "slot_mapping", "block_tables", "kv_lens", "logits_index")
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingMetadata))
# A speculating runner's plans also carry these (all of them, or none); not the block tables, which
# a plan holds once (StepPlan.block_tables, above) and the runner adds to the device's copy.
_SPECULATION_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculationMetadata)
                            if f.name != "block_tables")
# Fields a process that does not hold the last stage never reads: the [S, V] penalty arrays.
_LAST_STAGE_ONLY = frozenset({"output_counts", "seen_tokens"})
# Sampling fields a plan holds only when a row uses them (None otherwise): those and the bitmask.
_OPTIONAL = _LAST_STAGE_ONLY | {"token_bitmask"}
# The padding value of each trimmed table (step_plan.padding_plan / sampling_arrays fill them so).
_FILL = {"block_tables": 0, "sampling.stop_ids": -1, "sampling.token_bitmask": -1, "sampling.bias_ids": 0,
         "sampling.bias_values": 0}


def _trimmed(name: str, array: np.ndarray) -> np.ndarray:
    """The leading columns of a [S, N] table up to its last one that is not all padding."""
    if name not in _FILL:
        return array
    used = np.flatnonzero((array != _FILL[name]).any(axis=0))
    return array[:, :used[-1] + 1 if used.size else 0]


def encode_plan(plan: StepPlan, *, with_penalties: bool = True) -> bytes:
    """The plan's arrays as bytes. `with_penalties=False` leaves out the [S, V] penalty arrays (a
    follower without the last stage runs no sampler), which are most of a penalised step's bytes."""
    arrays = [(name, getattr(plan, name)) for name in _PLAN_ARRAYS]
    for name in _SAMPLING_FIELDS:
        value = getattr(plan.sampling, name)
        if value is None or (name in _LAST_STAGE_ONLY and not with_penalties):
            continue
        arrays.append((f"sampling.{name}", np.asarray(value)))
    if plan.speculation is not None:
        arrays += [(f"speculation.{name}", np.asarray(getattr(plan.speculation, name))) for name in _SPECULATION_FIELDS]
    stored = [(name, a, _trimmed(name, a)) for name, a in arrays]
    header = {"arrays": [[name, a.dtype.name, list(a.shape), part.shape[-1] if a.ndim else 0]
                         for name, a, part in stored],
              "num_real_tokens": plan.num_real_tokens, "num_padding_seqs": plan.num_padding_seqs}
    header_bytes = json.dumps(header).encode()
    body = b"".join(np.ascontiguousarray(part).tobytes() for _, _, part in stored)
    return _MAGIC + _HEADER_LENGTH.pack(len(header_bytes)) + header_bytes + body


def decode_plan(data: bytes) -> StepPlan:
    """The plan `encode_plan` wrote; ValueError for anything else."""
    if not data.startswith(_MAGIC):
        raise ValueError("not an encoded step plan (wrong magic bytes)")
    start = len(_MAGIC) + _HEADER_LENGTH.size
    if len(data) < start:
        raise ValueError("truncated step plan header")
    (header_length,) = _HEADER_LENGTH.unpack_from(data, len(_MAGIC))
    try:
        header = json.loads(data[start:start + header_length])
        entries = [(str(name), str(dtype), tuple(int(d) for d in shape), int(columns))
                   for name, dtype, shape, columns in header["arrays"]]
        counts = int(header["num_real_tokens"]), int(header["num_padding_seqs"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"unreadable step plan header: {error}") from None
    speculation_names = {f"speculation.{name}" for name in _SPECULATION_FIELDS}
    known = set(_PLAN_ARRAYS) | {f"sampling.{name}" for name in _SAMPLING_FIELDS} | speculation_names
    offset, arrays = start + header_length, {}
    for name, dtype, shape, columns in entries:
        if name not in known or name in arrays:
            raise ValueError(f"step plan field {name!r} is unknown or repeated")
        trimmed = name in _FILL and len(shape) == 2
        if dtype not in _DTYPES or any(d < 0 for d in shape) or not 0 <= columns <= (shape[-1] if shape else 0):
            raise ValueError(f"step plan field {name!r} has dtype {dtype} shape {shape} ({columns} columns sent)")
        stored_shape = (shape[0], columns) if trimmed else shape
        count = int(np.prod(stored_shape, dtype=np.int64))
        size = count * np.dtype(dtype).itemsize
        if offset + size > len(data):
            raise ValueError(f"step plan is truncated in field {name!r}")
        part = np.frombuffer(data, dtype, count=count, offset=offset).reshape(stored_shape)
        if trimmed:
            arrays[name] = np.full(shape, _FILL[name], dtype)
            arrays[name][:, :columns] = part
        else:
            arrays[name] = part
        offset += size
    if offset != len(data):
        raise ValueError(f"step plan has {len(data) - offset} stray bytes at its end")
    speculating = bool(speculation_names & arrays.keys())
    missing = [n for n in known - arrays.keys()
               if n.removeprefix("sampling.") not in _OPTIONAL and (speculating or n not in speculation_names)]
    if missing:
        raise ValueError(f"step plan lacks {sorted(missing)}")
    sampling = {name: arrays.get(f"sampling.{name}") for name in _SAMPLING_FIELDS}
    for flag in ("use_penalties", "use_bitmask", "use_logit_bias", "need_logprobs"):
        sampling[flag] = np.bool_(sampling[flag])  # encoded as 0-d arrays, kept as numpy scalars
    sampling["num_real_rows"] = np.int32(sampling["num_real_rows"])
    speculation = None
    if speculating:
        fields = {name: arrays[f"speculation.{name}"] for name in _SPECULATION_FIELDS}
        fields["any_proposes"] = np.bool_(fields["any_proposes"])
        speculation = SpeculationMetadata(**fields)
    return StepPlan(**{name: arrays[name] for name in _PLAN_ARRAYS}, sampling=SamplingMetadata(**sampling),
                    speculation=speculation, num_real_tokens=counts[0], num_padding_seqs=counts[1])
