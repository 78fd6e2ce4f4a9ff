"""Maps weights in the common "llama.cpp names, [out, in] layout" form onto the decoder's parameters.

Both importers (GGUF, HF safetensors) first bring their tensors to this one form, keyed by GGUF
tensor names (`token_embd.weight`, `blk.0.attn_q.weight`, ...) with matrices stored [out, in] as
PyTorch and GGUF do; `to_decoder_params` then transposes and reshapes them into the decoder's
[in, out] kernels with explicit head axes. One mapping, so the two importers cannot disagree.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from orca_jax.config import ModelConfig


class WeightMappingError(ValueError):
    pass


def numpy_dtype(name: str) -> np.dtype:
    """numpy has no bfloat16 of its own; ml_dtypes (which jax depends on) provides it."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def to_decoder_params(config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Returns flat decoder params {"layers.0.attn.q.kernel": array} from GGUF-named tensors, all in
    `config.dtype` (the checkpoint's own; tensors a checkpoint keeps wider, such as float32 norms in a
    bfloat16 file, are narrowed to it as the model computes in one dtype)."""
    dtype = numpy_dtype(config.dtype)
    remaining = dict(tensors)

    def take(name: str) -> np.ndarray:
        if name not in remaining:
            raise WeightMappingError(f"tensor {name!r} is missing from the checkpoint being imported")
        return np.asarray(remaining.pop(name), dtype=dtype)

    d, h, k, dh = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
    gpt2 = config.architecture == "gpt2"
    out: dict[str, np.ndarray] = {"embed.embedding": take("token_embd.weight")}
    if gpt2:
        out["pos_embed.embedding"] = take("position_embd.weight")

    def norm(dest: str, src: str) -> None:
        out[f"{dest}.scale"] = take(f"{src}.weight")
        if gpt2:
            out[f"{dest}.bias"] = take(f"{src}.bias")

    for i in range(config.n_layers):
        src, dest = f"blk.{i}", f"layers.{i}"
        norm(f"{dest}.attn_norm", f"{src}.attn_norm")
        norm(f"{dest}.mlp_norm", f"{src}.ffn_norm")
        if config.post_norms:
            norm(f"{dest}.post_attn_norm", f"{src}.post_attention_norm")
            norm(f"{dest}.post_mlp_norm", f"{src}.post_ffw_norm")
        if gpt2:
            qkv = take(f"{src}.attn_qkv.weight")  # [3 * H * Dh, D]
            qkv_bias = take(f"{src}.attn_qkv.bias")
            projections = dict(zip("qkv", np.split(qkv, 3, axis=0)))
            biases = dict(zip("qkv", np.split(qkv_bias, 3)))
        else:
            projections = {p: take(f"{src}.attn_{p}.weight") for p in "qkv"}
            biases = {}
            if config.qkv_bias:
                biases = {p: take(f"{src}.attn_{p}.bias") for p in "qkv"}
            if config.qk_norm:  # one scale per head dim, shared by the heads
                out[f"{dest}.attn.q_norm.scale"] = take(f"{src}.attn_q_norm.weight")
                out[f"{dest}.attn.k_norm.scale"] = take(f"{src}.attn_k_norm.weight")
        for p, heads in (("q", h), ("k", k), ("v", k)):
            out[f"{dest}.attn.{p}.kernel"] = projections[p].T.reshape(d, heads, dh)
            if biases:
                out[f"{dest}.attn.{p}.bias"] = biases[p].reshape(heads, dh)
        out[f"{dest}.attn.o.kernel"] = take(f"{src}.attn_output.weight").T.reshape(h, dh, d)
        mlp_parts = ("up", "down") if gpt2 else ("gate", "up", "down")
        for part in mlp_parts:
            out[f"{dest}.mlp.{part}.kernel"] = take(f"{src}.ffn_{part}.weight").T
        if gpt2:
            out[f"{dest}.attn.o.bias"] = take(f"{src}.attn_output.bias")
            for part in mlp_parts:
                out[f"{dest}.mlp.{part}.bias"] = take(f"{src}.ffn_{part}.bias")
    norm("final_norm", "output_norm")
    if not config.tie_word_embeddings:
        out["lm_head.embedding"] = take("output.weight")
    elif "output.weight" in remaining:
        remaining.pop("output.weight")  # a tied model may still ship a copy of the head
    # Rotary caches and other non-parameters some exporters include.
    leftover = sorted(n for n in remaining if not n.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise WeightMappingError(f"tensors the {config.architecture} layout does not use: {leftover[:8]}")
    return out
