"""A GGUF file served as it is (`LLM("model.gguf")`, `orca-jax serve model.gguf`): its config and
tokenizer read from the file's metadata, its parameters from its tensors when the runner asks for
them, and nothing written.

With `--quantization gguf` (the default for a GGUF file) the weight matrices are the file's own
blocks, which model/quantization.py takes from the file's memory map; only the small tensors (norms,
biases, and any matrix of a type with no kernel) are read here, dequantized. Otherwise every tensor is
read here, dequantized, one model part (a layer) at a time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orca_jax.checkpoint.gguf_import import file_matrices, open_gguf
from orca_jax.checkpoint.gguf_reader import GGUFReader
from orca_jax.checkpoint.layout import ImportedModel, Part, to_decoder_params
from orca_jax.checkpoint.store import LoadedModel, flatten_params, restore_stage
from orca_jax.model.decoder import abstract_decoder
from orca_jax.model.relayout import filled


def parameter_part(name: str) -> Part:
    """The model part a decoder parameter ("layers.3.attn.q.kernel") is made from."""
    head, rest = name.split(".", 1)
    if head == "layers":
        return int(rest.split(".", 1)[0])
    return "embed" if head in ("embed", "pos_embed") else "head"


def matrix_parameter(matrix: str) -> str:
    """A matrix's parameter name: an Embed's table ("embed", "lm_head") or a Dense's kernel."""
    return f"{matrix}.embedding" if matrix in ("embed", "lm_head") else f"{matrix}.kernel"


@dataclasses.dataclass
class GGUFWeights:
    """The decoder's parameters from a GGUF file, each read when asked for; a part's matrices that
    are not asked for (served in place from the file's blocks) are not read at all."""

    path: Path
    reader: GGUFReader
    imported: ImportedModel
    architecture: str  # the file's general.architecture
    read: dict[str, int] = dataclasses.field(default_factory=dict)  # parameter name -> bytes read

    @classmethod
    def open(cls, path: str | Path, name: str | None = None) -> "GGUFWeights":
        path = Path(path)
        reader = GGUFReader(str(path))
        imported = open_gguf(path, name or path.stem, reader)
        return cls(path, reader, imported, str(reader.fields["general.architecture"].contents()))

    def describe(self) -> str:  # the same on every host, wherever the file is mounted
        return "gguf"

    def summary(self) -> str:
        return f"read {len(self.read)} parameters ({sum(self.read.values()) / 2**20:.1f} MiB) from {self.path}"

    def stage_params(self, abstract_state, shardings, *, layers: range, tied: bool):
        return restore_stage(self.restore, abstract_state, shardings, layers=layers, tied=tied)

    def restore(self, wanted: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
        """The parameters named in `wanted`, each placed by its sharding in its dtype, a part at a time
        (the host holds one layer's dequantized tensors, never the model's)."""
        placed = {}
        for params in self._read_parts(wanted):
            for name, array in params.items():
                spec = wanted[name]
                placed[name] = jax.device_put(np.asarray(array, spec.dtype), spec.sharding)
                self.read[name] = placed[name].nbytes
        return placed

    def read_params(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """The parameters `names` as host arrays in the file's float dtype."""
        return {name: array for params in self._read_parts(names) for name, array in params.items()}

    def _read_parts(self, names: Iterable[str]) -> Iterator[dict[str, np.ndarray]]:
        config = self.imported.config
        wanted_by_part: dict[Part, set[str]] = {}
        for name in names:
            wanted_by_part.setdefault(parameter_part(name), set()).add(name)
        file_names = {t.name for t in self.reader.tensors}
        for part, wanted in wanted_by_part.items():
            skip, in_place = set(), set()
            for tensor, matrices in file_matrices(config, self.architecture, part, file_names).items():
                kernels = {matrix_parameter(m) for m in matrices}
                if not kernels & wanted:
                    skip.add(tensor)
                    in_place |= kernels
            params = to_decoder_params(config, part, self.imported.read_part(part, frozenset(skip)),
                                       frozenset(in_place))
            yield {name: params[name] for name in wanted}


def load_gguf_model(path: str | Path, dtype: str | None = None) -> LoadedModel:
    """A GGUF file's model with all its weights dequantized, whole on the host (tests and tools, as
    store.load_model for a checkpoint; the engine reads them per stage or serves the blocks in place).
    `dtype` casts the weights and the model's compute; None keeps the file's."""
    weights = GGUFWeights.open(path)
    config = weights.imported.config if dtype is None else dataclasses.replace(weights.imported.config, dtype=dtype)
    abstract = nnx.state(abstract_decoder(config))
    specs = flatten_params(nnx.to_pure_dict(abstract))
    arrays = {name: jnp.asarray(array, specs[name].dtype) for name, array in weights.read_params(specs).items()}
    model = nnx.merge(nnx.graphdef(abstract_decoder(config)), filled(abstract, abstract, arrays))
    return LoadedModel(config, model, weights.imported.tokenizer, weights.path)
