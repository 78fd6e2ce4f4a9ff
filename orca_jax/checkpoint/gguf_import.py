"""Import a GGUF file (llama.cpp's format): model config, dequantized weights, tokenizer.

Quantized weights are dequantized to float32; a file whose weight matrices are all F16 (or all
BF16) keeps that dtype, as the HF import does. Llama 3.x files carry their RoPE scaling as a
`rope_freqs` tensor (one divisor per rotary pair, computed by llama.cpp's converter from the HF
`rope_scaling`); it is kept exactly as `rope_scaling = "freq_factors"`.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from orca_jax.checkpoint.layout import to_decoder_params
from orca_jax.config import ModelConfig
from orca_jax.tokenizer import Tokenizer, byte_level_bpe

SUPPORTED_ARCHITECTURES = ("llama", "gpt2")
ROPE_FREQS = "rope_freqs.weight"
# Weight types kept as they are; every other type is dequantized to float32.
KEPT_TYPES = {gguf.GGMLQuantizationType.F16: "float16", gguf.GGMLQuantizationType.BF16: "bfloat16"}
# llama.cpp pre-tokenizer names that are byte-level BPE with digits split one by one first.
SPLIT_DIGIT_PRE_TOKENIZERS = ("smollm",)
PLAIN_BYTE_LEVEL_PRE_TOKENIZERS = ("gpt2", "default")


class GGUFImportError(ValueError):
    pass


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def unpermute_llama_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's row permutation of Q/K weights (made for interleaved RoPE), giving the
    half-split layout our rotary embedding uses. `weight` is [num_heads * Dh, D]."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_gguf(path: str | Path, name: str) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None]:
    """Returns (config, flat decoder params, tokenizer) of the GGUF file at `path`."""
    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"{path}: architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )

    def meta(key: str, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise GGUFImportError(f"{path}: metadata key {arch}.{key} is missing")
        return value

    tokens = _field(reader, "tokenizer.ggml.tokens")
    n_heads = int(meta("attention.head_count"))
    d_model = int(meta("embedding_length"))
    head_dim = d_model // n_heads
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = len(tokens) if tokens is not None else int(meta("vocab_size"))
    eps_key = "attention.layer_norm_rms_epsilon" if arch == "llama" else "attention.layer_norm_epsilon"
    config = ModelConfig(
        name=name,
        architecture=arch,
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=int(meta("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        d_ff=int(meta("feed_forward_length")),
        max_position=int(meta("context_length")),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", head_dim)),
        # float32 round trip: GGUF stores eps as float32 (1e-5 reads back as 9.99999974e-06).
        norm_eps=float(np.float32(meta(eps_key))),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        **_rope_scaling(reader, arch, path),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        dtype=_weights_dtype(reader),
    )
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # in the config already
        # GGUF lists dims innermost first; dequantize returns numpy in [out, in] order. F16 and BF16
        # widen to float32 exactly, so narrowing back to the file's dtype (to_decoder_params) is lossless.
        tensors[tensor.name] = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    if arch == "llama":
        for i in range(config.n_layers):
            tensors[f"blk.{i}.attn_q.weight"] = unpermute_llama_qk(tensors[f"blk.{i}.attn_q.weight"], config.n_heads)
            tensors[f"blk.{i}.attn_k.weight"] = unpermute_llama_qk(tensors[f"blk.{i}.attn_k.weight"], config.n_kv_heads)
    params = to_decoder_params(config, tensors)
    tokenizer = _tokenizer(reader, path, config) if tokens is not None else None
    return config, params, tokenizer


def _rope_scaling(reader: gguf.GGUFReader, arch: str, path: str | Path) -> dict:
    """ModelConfig's rope fields. llama.cpp's converter writes Llama 3.x's scaling as the `rope_freqs`
    tensor and no scaling metadata; linear, YaRN and LongRoPE scaling come as `{arch}.rope.scaling.type`,
    which this engine does not implement, so they are refused rather than silently run unscaled."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind != "none":
        raise GGUFImportError(f"{path}: rope scaling type {kind!r} ({arch}.rope.scaling.type) is not supported; "
                              "supported: plain RoPE and Llama 3.x frequency factors (the rope_freqs tensor)")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is None:
        return {}
    factors = gguf.quants.dequantize(freqs.data, freqs.tensor_type).astype(np.float32).reshape(-1)
    return {"rope_scaling": "freq_factors", "rope_freq_factors": tuple(float(f) for f in factors)}


def _weights_dtype(reader: gguf.GGUFReader) -> str:
    """float16 or bfloat16 when every weight matrix is stored so (norms are F32 even then), else float32."""
    matrix_types = {t.tensor_type for t in reader.tensors if len(t.shape) == 2}
    return KEPT_TYPES.get(matrix_types.pop(), "float32") if len(matrix_types) == 1 else "float32"


def _tokenizer(reader: gguf.GGUFReader, path: str | Path, config: ModelConfig) -> Tokenizer:
    kind = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GGUFImportError(
            f"{path}: tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') tokenizers can be imported. "
            "Convert the HF folder instead (its tokenizer.json is used as is)."
        )
    if pre not in SPLIT_DIGIT_PRE_TOKENIZERS + PLAIN_BYTE_LEVEL_PRE_TOKENIZERS:
        raise GGUFImportError(
            f"{path}: pre-tokenizer {pre!r} is not supported (supported: "
            f"{list(SPLIT_DIGIT_PRE_TOKENIZERS + PLAIN_BYTE_LEVEL_PRE_TOKENIZERS)}). "
            "Convert the HF folder instead (its tokenizer.json is used as is)."
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    control = [i for i, t in enumerate(token_types) if t == gguf.TokenType.CONTROL]
    hf = byte_level_bpe(tokens, _field(reader, "tokenizer.ggml.merges", []), control,
                        split_digits=pre in SPLIT_DIGIT_PRE_TOKENIZERS)
    return Tokenizer(
        hf,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )
