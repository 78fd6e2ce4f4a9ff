"""Quantized weights on the device (`--quantization gguf|int8`): the decoder's matrices swapped for
quantized rows that the matmuls read as they are (pallas_kernels/quantized_matmul.py). Also the
float32 model's matrices as rows for the same native kernel (`serve_float_rows`, matmul_impl).

- `gguf`: the blocks of the GGUF file the checkpoint was imported from (kept beside it as
  `model.gguf`), exactly as stored: SmolLM2's Q4_1 projections and its Q8_0 embedding (also the tied
  LM head) are what llama.cpp serves. Matrices the file stores in a type without a kernel (F32, F16,
  K-quants ...) keep the checkpoint's float weights, which the import dequantized exactly, and
  are logged.
- `int8`: every float matrix quantized at load per output channel (one scale per output row: the
  embedding's rows are the tied head's outputs), symmetric, round-half-even.

Norms, biases and activations stay in the model's dtype; the float model (`none`) remains the
reference the quantized ones are measured against. Quantized matrices are not split over devices:
EngineConfig refuses tensor_parallel_size > 1 with a quantization.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import weakref
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orca_jax.config import ConfigError
from orca_jax.model.layers import Dense, Embed, param
from orca_jax.optional import import_optional
from pallas_kernels.quantized_matmul import (BLOCK, FLOAT_NATIVE_MAX_TOKENS, NATIVE_MAX_TOKENS, check_weights,
                                             dequantize, quantize_int8, quantized_matmul)

log = logging.getLogger(__name__)

# GGUF tensor types (gguf.GGMLQuantizationType names) served in place, and their kernel's format name.
# By name: `gguf` is imported only when a GGUF is served (orca_jax/optional.py).
GGUF_KERNEL_FORMATS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}


@dataclasses.dataclass(frozen=True)
class Quantized:
    """How a Dense or Embed holding quantized rows computes (static: part of the compiled program)."""

    format: str  # one of pallas_kernels.quantized_matmul.FORMATS
    cpu_native: bool  # the native kernel is loaded: CPU programs call it
    native_max_tokens: int = NATIVE_MAX_TOKENS  # calls of more rows use XLA's dequantize-then-dot

    def matmul(self, x: jax.Array, weights: jax.Array, scales: jax.Array | None,
               num_rows: jax.Array | None = None) -> jax.Array:
        return quantized_matmul(x, self.format, weights, scales, num_rows, cpu_native=self.cpu_native,
                                native_max_tokens=self.native_max_tokens)

    def dequantize(self, rows: jax.Array, scales: jax.Array | None) -> jax.Array:
        return dequantize(self.format, rows, scales)


@dataclasses.dataclass
class QuantizationReport:
    """What `quantize_decoder` did, for the start-up line."""

    kept: dict[str, int]  # format -> matrices served quantized
    float_matrices: list[str]  # matrices left in the float dtype (no kernel for their type or shape)
    quantized_bytes: int

    def one_line(self) -> str:
        kept = ", ".join(f"{n} {fmt}" for fmt, n in sorted(self.kept.items()))
        rest = f"; {len(self.float_matrices)} left in float" if self.float_matrices else ""
        return f"quantized matrices: {kept} ({self.quantized_bytes / 2**20:.0f} MiB){rest}"


def quantize_decoder(model: nnx.Module, quantization: str, checkpoint_dir: Path,
                     native_max_tokens: int = NATIVE_MAX_TOKENS) -> tuple[nnx.Module, QuantizationReport]:
    """A copy of `model` (a Decoder; the given one is left as it is) with its matrices quantized.
    `native_max_tokens`: the most rows a call sends to the native kernel on CPU (tests raise it)."""
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, state)  # new modules over the same arrays
    kernel = functools.partial(Quantized, cpu_native=_native_kernel_loaded(), native_max_tokens=native_max_tokens)
    report = QuantizationReport({}, [], 0)
    if quantization == "gguf":
        import_optional("gguf", "quantization='gguf'", ConfigError)  # gguf_import needs it
        from orca_jax.checkpoint.gguf_import import GGUF_FILE

        _serve_gguf_blocks(model, Path(checkpoint_dir) / GGUF_FILE, kernel, report)
    elif quantization == "int8":
        for name, module in _matrices(model).items():
            _quantize_int8(name, module, kernel, report)
    else:
        raise ConfigError(f"quantize_decoder: unknown quantization {quantization!r}")
    return model, report


def _matrices(model) -> dict[str, Dense | Embed]:
    """The decoder's matrices by GGUF tensor name (the names the import maps from)."""
    out: dict[str, Dense | Embed] = {"token_embd.weight": model.embed}
    if model.lm_head is not None:
        out["output.weight"] = model.lm_head
    for i, layer in enumerate(model.layers):
        parts = {"attn_q": layer.attn.q, "attn_k": layer.attn.k, "attn_v": layer.attn.v, "attn_output": layer.attn.o,
                 "ffn_up": layer.mlp.up, "ffn_down": layer.mlp.down}
        if hasattr(layer.mlp, "gate"):
            parts["ffn_gate"] = layer.mlp.gate
        out.update({f"blk.{i}.{part}.weight": module for part, module in parts.items()})
    return out


def _rows_shape(module: Dense | Embed) -> tuple[int, int]:
    """(out, in) of the matrix as [out, in] rows."""
    if isinstance(module, Embed):
        return tuple(module.embedding.shape)
    shape = module.kernel.shape
    return math.prod(shape[module.num_in_axes:]), math.prod(shape[:module.num_in_axes])


def _install(module: Dense | Embed, rows: np.ndarray, scales: np.ndarray | None, fmt: str,
             kernel: Callable[[str], Quantized], report: QuantizationReport) -> None:
    # Whole matrices on each device (tp = 1): no logical axes to split them by.
    weights = param(jnp.asarray(rows), (None, None))
    if isinstance(module, Embed):
        module.embedding = weights
    else:
        module.kernel = weights
    module.scales = None if scales is None else param(jnp.asarray(scales), (None,))
    module.quantized = kernel(fmt)
    report.kept[fmt] = report.kept.get(fmt, 0) + 1
    report.quantized_bytes += rows.nbytes + (0 if scales is None else scales.nbytes)


def _quantize_int8(name: str, module: Dense | Embed, kernel: Callable[[str], Quantized], report: QuantizationReport) -> None:
    out, inner = _rows_shape(module)
    if inner % BLOCK:
        log.warning("%s: in=%d is not a multiple of %d, which the int8 kernel needs; kept in float", name, inner, BLOCK)
        report.float_matrices.append(name)
        return
    if isinstance(module, Embed):
        w = np.asarray(module.embedding[...], np.float32)
    else:  # kernel [in..., out...] -> rows [out, in]
        w = np.asarray(module.kernel[...], np.float32).reshape(inner, out).T
    q, scales = quantize_int8(w)
    _install(module, q, scales, "int8", kernel, report)


def _serve_gguf_blocks(model, path: Path, kernel: Callable[[str], Quantized], report: QuantizationReport) -> None:
    import gguf

    from orca_jax.checkpoint.gguf_import import unpermute_llama_qk

    if not path.is_file():
        raise ConfigError(f"quantization='gguf' needs the GGUF file the checkpoint was imported from at {path}; "
                          f"checkpoints pulled or converted before it was kept lack it: run `orca-jax pull --force "
                          f"{model.config.name}` (or `orca-jax convert <file.gguf> --name {model.config.name}`)")
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if arch != "llama":
        raise ConfigError(f"quantization='gguf' serves llama-architecture GGUFs (their tensors map one to one onto "
                          f"the decoder's matrices); {path} is {arch!r}: use quantization='int8'")
    tensors = {t.name: t for t in reader.tensors}
    heads = {"attn_q": model.config.n_heads, "attn_k": model.config.n_kv_heads}
    for name, module in _matrices(model).items():
        tensor = tensors.get(name)
        fmt = None if tensor is None else GGUF_KERNEL_FORMATS.get(tensor.tensor_type.name)
        if fmt is None:
            kind = "missing" if tensor is None else tensor.tensor_type.name
            log.warning("%s: %s in %s has no quantized kernel; computed from the checkpoint's float weights",
                        name, kind, path.name)
            report.float_matrices.append(name)
            continue
        rows = np.asarray(tensor.data)  # [out, in / 32 * block bytes], the file's bytes
        out, inner = _rows_shape(module)
        try:
            check_weights(fmt, rows.shape, inner)
            if rows.shape[0] != out:
                raise ValueError(f"{rows.shape[0]} rows where the model has {out} outputs")
        except ValueError as error:
            raise ConfigError(f"{path}: {name} does not fit {model.config.name}'s {out} x {inner} matrix ({error}); "
                              "the GGUF is not the one this checkpoint was imported from: convert it again") from None
        part = name.split(".")[-2]
        if part in heads:  # llama.cpp's row order for interleaved RoPE, undone as the import does
            rows = unpermute_llama_qk(rows, heads[part])
        _install(module, np.ascontiguousarray(rows), None, fmt, kernel, report)


def _native_kernel_loaded() -> bool:
    from orca_jax.model.paged_attention import native_cache_dir
    from pallas_kernels import native

    reason = native.unavailable_reason(native_cache_dir())
    if reason is not None:
        log.warning("quantized matmuls on CPU run as XLA's dequantize-then-dot (slower): %s", reason)
    return reason is None


# ---- float32 rows for the native kernel (`matmul_impl="native"`) ---------------------------------

def resolve_matmul_impl(requested: str, platform: str, dtype: str, tensor_parallel_size: int) -> str:
    """config.MatmulImpl for the devices: "auto" is "native" on CPU for a float32 model at tp = 1 with
    the native library loaded in its AVX2 or AVX-512 variant, "xla" otherwise; "native" where it
    cannot run is refused, saying why."""
    if requested == "xla":
        return "xla"
    from orca_jax.model.paged_attention import native_cache_dir
    from pallas_kernels import native

    reasons = [why for why, fails in (
        (f"it runs on CPU, not on {platform!r}", platform != "cpu"),
        (f"it multiplies float32 matrices; this model runs in {dtype}", dtype != "float32"),
        ("it needs whole matrices on each device (tensor_parallel_size=1)", tensor_parallel_size != 1)) if fails]
    if not reasons:
        unavailable = native.unavailable_reason(native_cache_dir())
        if unavailable is not None:
            reasons.append(unavailable)
    if not reasons:
        if requested == "auto" and native.isa() == "base":
            # The baseline variant has no fused multiply-add instruction (libm's, lane by lane): it
            # gives the same bits, far slower than XLA's dot.
            return "xla"
        return "native"
    if requested == "native":
        raise ConfigError(f"matmul_impl='native': {'; '.join(reasons)}; use matmul_impl='auto' or 'xla'")
    return "xla"


# Transposed copies already made, by the kernel array they came from and the placement: engines
# built over one loaded model (a session's tests, an LLM rebuilt with other limits) share them
# instead of each holding another copy of every matrix. An entry goes with its kernel array.
_FLOAT_ROWS: dict[tuple[int, object], tuple[weakref.ref, jax.Array]] = {}


def serve_float_rows(stage: nnx.Module, sharding, native_max_tokens: int = FLOAT_NATIVE_MAX_TOKENS) -> None:
    """Has the native kernel compute the float32 matrices of `stage` (a DecoderStage whose params
    are on their devices, tp = 1) in calls of up to `native_max_tokens` rows, XLA the larger ones:
    each Dense kernel [in..., out...] becomes rows [out, in] ("f32" format, transposed on the device
    and placed with `sharding`); a tied embedding is already the head's rows and is kept as it is.
    Matrices whose `in` is not a multiple of the kernel's 32-wide block stay with XLA."""
    kernel = Quantized("f32", cpu_native=True, native_max_tokens=native_max_tokens)
    for _, module in nnx.iter_graph(stage):
        if isinstance(module, Dense) and module.quantized is None:
            out, inner = _rows_shape(module)
            if inner % BLOCK:
                continue
            module.kernel = param(_float_rows(module.kernel[...], inner, out, sharding), (None, None))
            module.quantized = kernel
    head = getattr(stage, "head", None)
    if isinstance(head, Embed) and head.quantized is None and head.embedding.shape[1] % BLOCK == 0:
        head.quantized = kernel


def _float_rows(matrix: jax.Array, inner: int, out: int, sharding) -> jax.Array:
    key = (id(matrix), sharding)
    cached = _FLOAT_ROWS.get(key)
    if cached is not None and cached[0]() is matrix:
        return cached[1]
    rows = jax.device_put(jnp.asarray(matrix, jnp.float32).reshape(inner, out).T, sharding)
    _FLOAT_ROWS[key] = (weakref.ref(matrix, lambda _, key=key: _FLOAT_ROWS.pop(key, None)), rows)
    return rows
