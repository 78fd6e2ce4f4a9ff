"""Import a GGUF file (llama.cpp's format): model config, dequantized weights, tokenizer."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from orca_jax.checkpoint.layout import to_decoder_params
from orca_jax.config import ModelConfig
from orca_jax.tokenizer import Tokenizer, byte_level_bpe

SUPPORTED_ARCHITECTURES = ("llama", "gpt2")
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
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    tensors = {}
    for tensor in reader.tensors:
        # GGUF lists dims innermost first; dequantize returns numpy in [out, in] order.
        tensors[tensor.name] = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    if arch == "llama":
        for i in range(config.n_layers):
            tensors[f"blk.{i}.attn_q.weight"] = unpermute_llama_qk(tensors[f"blk.{i}.attn_q.weight"], config.n_heads)
            tensors[f"blk.{i}.attn_k.weight"] = unpermute_llama_qk(tensors[f"blk.{i}.attn_k.weight"], config.n_kv_heads)
    params = to_decoder_params(config, tensors)
    tokenizer = _tokenizer(reader, path, config) if tokens is not None else None
    return config, params, tokenizer


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
