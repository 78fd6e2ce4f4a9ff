"""Maps weights in the common "llama.cpp names, [out, in] layout" form onto the decoder's parameters.

Both importers (GGUF, HF safetensors) first bring their tensors to this one form, keyed by GGUF
tensor names (`token_embd.weight`, `blk.0.attn_q.weight`, ...) with matrices stored [out, in] as
PyTorch and GGUF do; `to_decoder_params` then transposes and reshapes them into the decoder's
[in, out] kernels with explicit head axes, one part of the model (a layer) at a time. One mapping,
so the two importers cannot disagree.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import ml_dtypes
import numpy as np

from orca_jax.config import ModelConfig
from orca_jax.tokenizer import Tokenizer


class WeightMappingError(ValueError):
    pass


def numpy_dtype(name: str) -> np.dtype:
    """numpy has no bfloat16 of its own; ml_dtypes (which jax depends on) provides it."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


# An import goes part by part, one layer at a time, so it holds one layer of the model, never all of it:
# "embed" (token and position embeddings), each layer by its index, then "head" (final norm, LM head).
Part = str | int


@dataclasses.dataclass(frozen=True)
class ImportedModel:
    """A model file being imported: its config, its tokenizer, and its tensors, read one part at a time."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    # a part's tensors, GGUF-named, [out, in] (a GGUF's also takes `skip`: tensor names not to read)
    read_part: Callable[..., dict[str, np.ndarray]]


def model_parts(config: ModelConfig) -> list[Part]:
    return ["embed", *range(config.n_layers), "head"]


def tensor_part(name: str) -> Part:
    """The part a GGUF-named tensor belongs to (`blk.3.attn_q.weight` -> 3)."""
    if name.startswith("blk."):
        return int(name.split(".")[1])
    return "embed" if name.startswith(("token_embd.", "position_embd.")) else "head"


def names_by_part(config: ModelConfig, names) -> dict[Part, list[str]]:
    """The tensor names of each part, every part present (a part's missing tensors are named when it
    is mapped); a layer the config does not have is refused, never silently left out."""
    by_part: dict[Part, list[str]] = {part: [] for part in model_parts(config)}
    for name in names:
        part = tensor_part(name)
        if part not in by_part:
            raise WeightMappingError(f"tensor {name!r} is for layer {part}, but the model has "
                                     f"{config.n_layers} layers (0-{config.n_layers - 1})")
        by_part[part].append(name)
    return by_part


def to_decoder_params(config: ModelConfig, part: Part, tensors: dict[str, np.ndarray],
                      in_place: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """Returns one part's flat decoder params {"layers.0.attn.q.kernel": array} from its GGUF-named
    tensors, all in `config.dtype` (the checkpoint's own; tensors a checkpoint keeps wider, such as
    float32 norms in a bfloat16 file, are narrowed to it as the model computes in one dtype).
    `in_place`: matrices ("layers.0.attn.q.kernel") served from the file's blocks as they are, whose
    tensors are not given and which are not made here."""
    dtype = numpy_dtype(config.dtype)
    remaining = dict(tensors)

    def take(name: str) -> np.ndarray:
        if name not in remaining:
            raise WeightMappingError(f"tensor {name!r} is missing from the checkpoint being imported")
        return np.asarray(remaining.pop(name), dtype=dtype)

    gpt2 = config.architecture == "gpt2"
    out: dict[str, np.ndarray] = {}

    def norm(dest: str, src: str) -> None:
        out[f"{dest}.scale"] = take(f"{src}.weight")
        if gpt2:
            out[f"{dest}.bias"] = take(f"{src}.bias")

    def matrix(dest: str, src: str, to_kernel=lambda rows: rows) -> None:
        if dest not in in_place:
            out[dest] = to_kernel(take(src))

    if part == "embed":
        matrix("embed.embedding", "token_embd.weight")
        if gpt2:
            out["pos_embed.embedding"] = take("position_embd.weight")
    elif part == "head":
        norm("final_norm", "output_norm")
        if not config.tie_word_embeddings:
            matrix("lm_head.embedding", "output.weight")
        elif "output.weight" in remaining:
            remaining.pop("output.weight")  # a tied model may still ship a copy of the head
    else:  # a layer
        d, h, k, dh = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        src, dest = f"blk.{part}", f"layers.{part}"
        norm(f"{dest}.attn_norm", f"{src}.attn_norm")
        norm(f"{dest}.mlp_norm", f"{src}.ffn_norm")
        if config.post_norms:
            norm(f"{dest}.post_attn_norm", f"{src}.post_attention_norm")
            norm(f"{dest}.post_mlp_norm", f"{src}.post_ffw_norm")
        heads = {"q": h, "k": k, "v": k}
        if gpt2:  # q, k and v in one matrix [3 * H * Dh, D], and their biases in one vector
            if not all(f"{dest}.attn.{p}.kernel" in in_place for p in "qkv"):
                for p, rows in zip("qkv", np.split(take(f"{src}.attn_qkv.weight"), 3, axis=0)):
                    out[f"{dest}.attn.{p}.kernel"] = rows.T.reshape(d, heads[p], dh)
            for p, bias in zip("qkv", np.split(take(f"{src}.attn_qkv.bias"), 3)):
                out[f"{dest}.attn.{p}.bias"] = bias.reshape(heads[p], dh)
        else:
            for p in "qkv":
                matrix(f"{dest}.attn.{p}.kernel", f"{src}.attn_{p}.weight",
                       lambda rows, n=heads[p]: rows.T.reshape(d, n, dh))
                if config.qkv_bias:
                    out[f"{dest}.attn.{p}.bias"] = take(f"{src}.attn_{p}.bias").reshape(heads[p], dh)
            if config.qk_norm:  # one scale per head dim, shared by the heads
                out[f"{dest}.attn.q_norm.scale"] = take(f"{src}.attn_q_norm.weight")
                out[f"{dest}.attn.k_norm.scale"] = take(f"{src}.attn_k_norm.weight")
        matrix(f"{dest}.attn.o.kernel", f"{src}.attn_output.weight", lambda rows: rows.T.reshape(h, dh, d))
        mlp_parts = ("up", "down") if gpt2 else ("gate", "up", "down")
        for mlp_part in mlp_parts:
            matrix(f"{dest}.mlp.{mlp_part}.kernel", f"{src}.ffn_{mlp_part}.weight", np.transpose)
        if gpt2:
            out[f"{dest}.attn.o.bias"] = take(f"{src}.attn_output.bias")
            for mlp_part in mlp_parts:
                out[f"{dest}.mlp.{mlp_part}.bias"] = take(f"{src}.ffn_{mlp_part}.bias")
    # Rotary caches and other non-parameters some exporters include.
    leftover = sorted(n for n in remaining if not n.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise WeightMappingError(f"tensors the {config.architecture} layout does not use: {leftover[:8]}")
    return out
