"""Quantized weights on the device (`--quantization gguf|int8`): the decoder rebuilt with quantized
linear methods (linear.py) for its matrices, whose matmuls read the quantized rows as they are
(pallas_kernels/quantized_matmul.py).

- `gguf`: the blocks of the GGUF file the checkpoint was imported from (kept beside it as
  `model.gguf`), exactly as stored: SmolLM2's Q4_1 projections and its Q8_0 embedding (also the tied
  LM head) are what llama.cpp serves; a `_M` K-quant file mixes types tensor by tensor (Q4_K, Q6_K,
  Q5_0 ...) and each keeps its own. Each tensor of a block type in linear.GGUF_BLOCK_TYPES gets a
  GGUFBlockLinear; matrices the file stores in another type (F32, F16, Q2_K, Q3_K, IQ* ...) keep the
  checkpoint's float weights, which the import dequantized exactly, and one log line names their
  types.
- `int8`: every float matrix quantized at load per output channel (one scale per output row: the
  embedding's rows are the tied head's outputs), symmetric, round-half-even: Int8Linear.

Either way the matrices take their inputs quantized to int8 per row and 32 values (llama.cpp's
method; the default for gguf) or as float32 (the default for int8 weights): `activations`, the
engine's `quantization_activations`.

Norms, biases and activations stay in the model's dtype; the float model (`none`) remains the
reference the quantized ones are measured against. Quantized matrices are not split over devices:
EngineConfig refuses tensor_parallel_size > 1 with a quantization.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orca_jax.checkpoint.layout import model_parts
from orca_jax.checkpoint.store import CheckpointWeights, flatten_params
from orca_jax.config import ConfigError, activations_for
from orca_jax.model.backends import native_matmuls
from orca_jax.model.decoder import Decoder
from orca_jax.model.layers import Dense, Embed
from orca_jax.model.linear import GGUF_BLOCK_TYPES, GGUFBlockLinear, Int8Linear, LinearMethod, RowsLinear
from orca_jax.model.relayout import abstract_relayout, array_at, matrices, relayout
from orca_jax.runner.huge_pages import huge_page_array
from orca_jax.optional import import_optional
from pallas_kernels.quantized_matmul import (ACTIVATIONS, BLOCK, INT8_NATIVE_MAX_TOKENS, NATIVE_MAX_TOKENS, check_weights,
                                             quantize_int8)

log = logging.getLogger(__name__)

# Where a model's parameters are read from: a checkpoint, or a GGUF file (checkpoint/gguf_weights.py).
Weights = Any  # CheckpointWeights | GGUFWeights


@dataclasses.dataclass
class QuantizationReport:
    """What `quantize_decoder` did, for the start-up line."""

    kept: dict[str, int]  # format -> matrices served quantized
    float_matrices: list[str]  # matrices left in the float dtype (no kernel for their type or shape)
    quantized_bytes: int
    activations: str = "float32"  # how the quantized matrices take their inputs
    dequantized_types: set[str] = dataclasses.field(default_factory=set)  # GGUF types left in float

    def one_line(self) -> str:
        kept = ", ".join(f"{n} {fmt}" for fmt, n in sorted(self.kept.items()))
        line = f"quantized matrices: {kept} ({self.quantized_bytes / 2**20:.0f} MiB), {self.activations} activations"
        if self.float_matrices:
            types = f" ({', '.join(sorted(self.dequantized_types))} dequantized)" if self.dequantized_types else ""
            line += f"; {len(self.float_matrices)} left in float{types}"
        return line


@dataclasses.dataclass
class _Quantized:
    """The matrices that change: their new methods, and the arrays they hold, by parameter name."""

    report: QuantizationReport
    methods: dict[str, LinearMethod] = dataclasses.field(default_factory=dict)
    arrays: dict[str, jnp.ndarray] = dataclasses.field(default_factory=dict)

    def add(self, path: str, module: Dense | Embed, method: RowsLinear, rows: np.ndarray,
            scales: np.ndarray | None) -> None:
        self.methods[path] = method
        self.arrays[_weights_name(path, module)] = _on_device(rows)
        if scales is not None:
            self.arrays[f"{path}.scales"] = _on_device(scales)
        self.report.kept[method.format] = self.report.kept.get(method.format, 0) + 1
        self.report.quantized_bytes += rows.nbytes + (0 if scales is None else scales.nbytes)


def _on_device(host: np.ndarray) -> jax.Array:
    """A host array on the default device: on CPU the same memory, not a copy (the GGUF blocks are
    read into 2 MB pages of their own: runner/huge_pages.huge_page_array), elsewhere copied there."""
    if jax.default_backend() == "cpu" and host.flags.c_contiguous and host.flags.writeable:
        return jnp.from_dlpack(host)
    return jnp.asarray(host)


def quantize_decoder(model: Decoder, quantization: str, weights: Weights | Path,
                     native_max_tokens: int | None = None,
                     activations: str = "auto") -> tuple[Decoder, QuantizationReport]:
    """A new decoder, `model`'s with its matrices quantized (the given one is left as it is).
    `weights`: where the model's parameters are, a checkpoint (its directory, or CheckpointWeights)
    or a GGUF file (GGUFWeights). `model` holds its arrays (load_model) or only their shapes
    (open_model, as the engine loads): then the float parameters are read from `weights` as they are
    needed, so a GGUF's matrices are never read as floats and int8 holds one layer's float matrices
    at a time.
    `native_max_tokens`: the most rows a call sends to the native kernel on CPU (None: the kernel's
    measured crossover with XLA for the activations, NATIVE_MAX_TOKENS or INT8_NATIVE_MAX_TOKENS).
    `activations`: how the quantized matrices take their inputs, "int8" or "float32"
    (pallas_kernels/int8_activations.py); "auto" as the engine's default (config.activations_for)."""
    if quantization not in ("gguf", "int8"):
        raise ConfigError(f"quantize_decoder: unknown quantization {quantization!r} (gguf or int8)")
    activations = activations_for(activations, quantization)
    if activations not in ACTIVATIONS:
        raise ConfigError(f"quantize_decoder: activations must be auto, {' or '.join(ACTIVATIONS)}, got {activations!r}")
    if native_max_tokens is None:
        native_max_tokens = INT8_NATIVE_MAX_TOKENS if activations == "int8" else NATIVE_MAX_TOKENS
    quantized = _Quantized(QuantizationReport({}, [], 0, activations=activations))
    if isinstance(weights, (str, Path)):
        weights = CheckpointWeights(Path(weights))
    floats = FloatParams(model, weights)
    cpu_native = native_matmuls()
    if quantization == "gguf":
        import_optional("gguf", "quantization='gguf'", ConfigError)  # gguf_import needs it
        _serve_gguf_blocks(model, weights, quantized,
                           lambda block_type: GGUFBlockLinear(block_type, cpu_native, native_max_tokens, activations))
    else:
        method = Int8Linear(cpu_native, native_max_tokens, activations)
        by_layer: dict[str, dict[str, tuple[str, Dense | Embed]]] = {}  # "blk.3" or "token_embd" -> its matrices
        for name, matrix in _matrices(model).items():
            by_layer.setdefault(name.rsplit(".", 2)[0] if name.startswith("blk.") else name, {})[name] = matrix
        for layer in by_layer.values():
            weights = floats.read([_weights_name(path, module) for path, module in layer.values()])
            for name, (path, module) in layer.items():
                _quantize_int8(name, path, module, weights[_weights_name(path, module)], method, quantized)
    kept = floats.read([name for name in floats.names if name not in quantized.arrays])
    return relayout(model, quantized.methods, quantized.arrays | kept), quantized.report


class FloatParams:
    """A float model's parameters by name ("layers.3.mlp.down.kernel"): its own arrays, or, when it
    holds only their shapes, read from its weights, just the ones asked for."""

    def __init__(self, model: Decoder, weights: Weights):
        self.values = nnx.to_pure_dict(nnx.state(model))
        self.names = list(flatten_params(self.values))
        self.weights = weights
        self.shapes_only = any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(self.values))

    def read(self, names: list[str]) -> dict[str, jax.Array]:
        found = {name: array_at(self.values, name) for name in names}
        if not self.shapes_only or not found:
            return found
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # this process's own (multi-host)
        return self.weights.restore({name: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=device)
                                     for name, spec in found.items()})


# Each layer's matrices by their GGUF tensor name (blk.<i>.<part>.weight) and their path in the layer.
GGUF_LAYER_PARTS = {"attn_q": "attn.q", "attn_k": "attn.k", "attn_v": "attn.v", "attn_output": "attn.o",
                    "ffn_up": "mlp.up", "ffn_down": "mlp.down", "ffn_gate": "mlp.gate"}


def _matrices(model: Decoder) -> dict[str, tuple[str, Dense | Embed]]:
    """The decoder's matrices by GGUF tensor name (the names the import maps from): (path, module)."""
    modules = matrices(model)
    paths = {"token_embd.weight": "embed", "output.weight": "lm_head"}
    for i in range(model.config.n_layers):
        paths.update({f"blk.{i}.{part}.weight": f"layers.{i}.{sub}" for part, sub in GGUF_LAYER_PARTS.items()})
    return {name: (path, modules[path]) for name, path in paths.items() if path in modules}


def _weights_name(path: str, module: Dense | Embed) -> str:
    return f"{path}.{'embedding' if isinstance(module, Embed) else 'kernel'}"


def _float_rows(module: Dense | Embed, weights: jax.Array) -> np.ndarray:
    """The float matrix as float32 rows [out, in] (a Dense's kernel is [in..., out...])."""
    out, inner = module.rows_shape
    if isinstance(module, Embed):
        return np.asarray(weights, np.float32)
    return np.asarray(weights, np.float32).reshape(inner, out).T


def _quantize_int8(name: str, path: str, module: Dense | Embed, weights: jax.Array, method: Int8Linear,
                   quantized: _Quantized) -> None:
    inner = module.rows_shape[1]
    if not method.fits(inner):
        log.warning("%s: in=%d is not a multiple of %d, which the int8 kernel needs; kept in float", name, inner, BLOCK)
        quantized.report.float_matrices.append(name)
        quantized.arrays[_weights_name(path, module)] = weights  # read already: not read again
        return
    quantized.add(path, module, method, *quantize_int8(_float_rows(module, weights)))


def _serve_gguf_blocks(model: Decoder, weights: Weights, quantized: _Quantized, method_of) -> None:
    """Each matrix of the file's `weights` that has a kernel for its block type becomes the file's
    rows as they are (a fused tensor's rows split among the matrices it holds); the others are named
    in one log line and computed from float weights."""
    from orca_jax.checkpoint.gguf_import import read_raw, unpermute_llama_qk

    path, reader, imported_from = _gguf_file(model, weights)
    in_place, left_in_float = gguf_in_place(model.config, reader, path)
    quantized.report.float_matrices.extend(name for names in left_in_float.values() for name in names)
    modules = matrices(model)
    # llama.cpp's converter permutes a llama file's q and k rows for interleaved RoPE; undone as the import does
    arch = reader.fields["general.architecture"].contents()
    permuted_heads = {"attn.q": model.config.n_heads, "attn.k": model.config.n_kv_heads} if arch == "llama" else {}
    for name, (tensor, paths) in in_place.items():
        method = method_of(tensor.tensor_type.name)
        # [out, in / block weights * block bytes], the file's bytes, in 2 MB pages the device takes as they are
        rows = read_raw(path, tensor, huge_page_array(tensor.data.shape, tensor.data.dtype))
        outs = [modules[p].rows_shape[0] for p in paths]
        try:
            check_weights(method.format, rows.shape, modules[paths[0]].rows_shape[1])
            if rows.shape[0] != sum(outs):
                raise ValueError(f"{rows.shape[0]} rows where the model has {' + '.join(map(str, outs))} outputs")
        except ValueError as error:
            cause = ("the GGUF is not the one this checkpoint was imported from: convert it again" if imported_from
                     else "the file's tensors do not match its own metadata")
            raise ConfigError(f"{path}: {name} does not fit {model.config.name}'s {' + '.join(paths)} "
                              f"({error}); {cause}") from None
        # A fused tensor's rows are its matrices' rows one after the other: each is a slice of blocks.
        for module_path, module_rows in zip(paths, np.split(rows, np.cumsum(outs)[:-1])):
            heads = permuted_heads.get(module_path.split(".", 2)[-1])  # "layers.3.attn.q" -> "attn.q"
            if heads is not None:
                unpermuted = huge_page_array(module_rows.shape, module_rows.dtype)
                unpermuted[...] = unpermute_llama_qk(module_rows, heads)
                module_rows = unpermuted
            quantized.add(module_path, modules[module_path], method, module_rows, None)
    if left_in_float:
        # One line for the whole file: a Q2_K or IQ* file would otherwise log every matrix.
        quantized.report.dequantized_types = set(left_in_float) - {"missing", *FLOAT_TYPES}
        log.warning("%s: no in-place kernel for %s: computed from float weights (dequantized exactly); served in "
                    "place: %s", path.name,
                    "; ".join(f"{kind} ({len(names)}: {_names(names)})" for kind, names in sorted(left_in_float.items())),
                    ", ".join(GGUF_BLOCK_TYPES))


def _gguf_file(model: Decoder, weights: Weights):
    """The GGUF file `--quantization gguf` serves, its reader, and whether it is the file a checkpoint
    was imported from (kept in the checkpoint) rather than the model itself."""
    from orca_jax.checkpoint.gguf_import import GGUF_FILE
    from orca_jax.checkpoint.gguf_reader import GGUFReader

    if getattr(weights, "reader", None) is not None:  # GGUFWeights: a file served as it is
        return weights.path, weights.reader, False
    path = weights.path / GGUF_FILE
    if not path.is_file():
        raise ConfigError(f"quantization='gguf' needs the GGUF file the checkpoint was imported from at {path}; "
                          f"checkpoints pulled or converted before it was kept lack it: run `orca-jax pull --force "
                          f"{model.config.name}` (or `orca-jax convert <file.gguf> --name {model.config.name}`), "
                          "or serve the .gguf file itself")
    return path, GGUFReader(str(path)), True


def gguf_in_place(config, reader, path: Path) -> tuple[dict[str, tuple], dict[str, list[str]]]:
    """Which of a GGUF file's matrices `--quantization gguf` serves from its blocks: tensor name ->
    (the reader's tensor, the decoder matrices its rows hold), and the others, left in float, by their
    GGUF type (F16, Q2_K, ...; "missing" for a tensor the file lacks) -> tensor names."""
    from orca_jax.checkpoint.gguf_import import SUPPORTED_ARCHITECTURES, file_matrices

    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"quantization='gguf': {path} is of architecture {arch!r}; supported: "
                          f"{list(SUPPORTED_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    in_place, left_in_float = {}, {}
    for part in model_parts(config):
        for name, paths in file_matrices(config, arch, part, tensors).items():
            tensor = tensors.get(name)
            if tensor is None or tensor.tensor_type.name not in GGUF_BLOCK_TYPES:
                left_in_float.setdefault("missing" if tensor is None else tensor.tensor_type.name, []).append(name)
            else:
                in_place[name] = (tensor, paths)
    return in_place, left_in_float


def abstract_gguf_decoder(model: Decoder, reader, path: Path) -> Decoder:
    """`model`'s structure (shapes only) as `--quantization gguf` serves the file: for the memory plan
    of a GGUF file before any of it is read (`orca-jax plan`)."""
    in_place, _ = gguf_in_place(model.config, reader, path)
    return abstract_relayout(model, {p: GGUFBlockLinear(tensor.tensor_type.name, cpu_native=False)
                                     for tensor, paths in in_place.values() for p in paths})


FLOAT_TYPES = ("F32", "F16", "BF16")  # GGUF tensor types that are float already


def _names(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
