"""Import a GGUF file (llama.cpp's format): model config, dequantized weights, tokenizer.

Architectures: llama (Llama, Mistral, SmolLM2, ...), gpt2, and the families of
checkpoint/hf_families.py as llama.cpp's converter writes them: qwen2, qwen3, phi3 (fused qkv and
gate/up, split here), gemma2 and gemma3 (norm weights already hold Gemma's 1 + w). What llama.cpp
keeps in code rather than in the file is filled in as it does: Gemma's attention scale
(1/sqrt(head_dim), 1/sqrt(d_model / heads) for the 27B models), its sliding layers (every other one
in Gemma 2; five of every six in Gemma 3) and Gemma 3's local RoPE base (10000).

Quantized weights are dequantized to float32; a file whose weight matrices are all F16 (or all
BF16) keeps that dtype, as the HF import does. Llama 3.x files carry their RoPE scaling as a
`rope_freqs` tensor (one divisor per rotary pair, computed by llama.cpp's converter from the HF
`rope_scaling`); it is kept exactly as `rope_scaling = "freq_factors"`.

Tokenizers: byte-level BPE (`tokenizer.ggml.model` "gpt2", with the pre-tokenizers of
checkpoint/gguf_pre_tokenizers.py) and SentencePiece BPE ("llama": Llama 2, Mistral, TinyLlama,
Gemma, Phi-3), rebuilt from the file's vocabulary, scores or merges, token types and flags so that
they give llama.cpp's ids for the same file, which are the model's own tokenizer's
(tests/checkpoint/test_llama_cpp_vocab_vectors.py).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from orca_jax.checkpoint.gguf_pre_tokenizers import IGNORE_MERGES, PRE_TOKENIZERS
from orca_jax.checkpoint.gguf_reader import GGUFReader
from orca_jax.checkpoint.hf_families import split_fused_phi3
from orca_jax.checkpoint.layout import ImportedModel, Part, names_by_part
from orca_jax.config import ModelConfig
from orca_jax.tokenizer import SPACE, Tokenizer, byte_level_bpe, merges_from_vocab, sentencepiece_bpe

SUPPORTED_ARCHITECTURES = ("llama", "gpt2", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp tells the 27B models by their depth
ROPE_FREQS = "rope_freqs.weight"
# A checkpoint imported from a GGUF keeps the file under this name: `--quantization gguf` serves its
# quantized blocks as they are (model/quantization.py).
GGUF_FILE = "model.gguf"
# Weight types kept as they are; every other type is dequantized to float32.
KEPT_TYPES = {gguf.GGMLQuantizationType.F16: "float16", gguf.GGMLQuantizationType.BF16: "bfloat16"}
SUPPORTED_TOKENIZERS = ("gpt2", "llama")  # tokenizer.ggml.model: byte-level BPE, SentencePiece BPE


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


def open_gguf(path: str | Path, name: str, reader: GGUFReader | None = None) -> ImportedModel:
    """The model in the GGUF file at `path`, its tensors read a layer at a time (`ImportedModel.read_part`);
    `reader`: the file already opened."""
    reader = reader or GGUFReader(str(path))
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
    end_ids = end_of_generation_ids(reader)  # once: the config and the tokenizer both take them
    n_heads = int(meta("attention.head_count"))
    d_model = int(meta("embedding_length"))
    head_dim = d_model // n_heads
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = len(tokens) if tokens is not None else int(meta("vocab_size"))
    eps_key = "attention.layer_norm_epsilon" if arch == "gpt2" else "attention.layer_norm_rms_epsilon"
    config = ModelConfig(
        name=name,
        architecture="gpt2" if arch == "gpt2" else "llama",
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
        extra_eos_token_ids=end_ids,
        dtype=_weights_dtype(reader),
        **_family_switches(reader, arch, n_heads, d_model),
    )
    by_name = {t.name: t for t in reader.tensors if t.name != ROPE_FREQS}  # rope_freqs: in the config already
    by_part = names_by_part(config, by_name)

    def read_part(part: Part, skip: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
        """The part's tensors dequantized, but those named in `skip` (matrices served in place)."""
        tensors = {name: _read_tensor(path, by_name[name]) for name in by_part[part] if name not in skip}
        if arch == "llama" and isinstance(part, int):
            for p, heads in (("q", config.n_heads), ("k", config.n_kv_heads)):
                if f"blk.{part}.attn_{p}.weight" in tensors:  # (a missing one is named when the layer is mapped)
                    tensors[f"blk.{part}.attn_{p}.weight"] = unpermute_llama_qk(tensors[f"blk.{part}.attn_{p}.weight"],
                                                                                heads)
        if arch == "phi3" and isinstance(part, int):
            # llama.cpp keeps Phi-3's [gate; up] as one ffn_up (and reads files with them apart)
            if f"blk.{part}.ffn_gate.weight" not in by_name and f"blk.{part}.ffn_up.weight" in tensors:
                tensors[f"blk.{part}.ffn_gate_up.weight"] = tensors.pop(f"blk.{part}.ffn_up.weight")
            split_fused_phi3(tensors, config)
        return tensors

    tokenizer = gguf_tokenizer(reader, path, end_ids) if tokens is not None else None
    return ImportedModel(config, tokenizer, read_part)


def file_matrices(config: ModelConfig, arch: str, part: Part, names) -> dict[str, tuple[str, ...]]:
    """A part's weight matrices as the file `names` its tensors: tensor name -> the decoder matrices
    ("layers.3.attn.q") its rows hold, in row order. A fused tensor holds several: GPT-2's and
    Phi-3's attn_qkv [q; k; v], Phi-3's ffn_up [gate; up] (llama.cpp also reads Phi-3 files with
    them apart)."""
    if part == "embed":
        return {"token_embd.weight": ("embed",)}
    if part == "head":
        return {} if config.tie_word_embeddings else {"output.weight": ("lm_head",)}
    src, dest = f"blk.{part}", f"layers.{part}"
    if f"{src}.attn_qkv.weight" in names:
        matrices = {f"{src}.attn_qkv.weight": tuple(f"{dest}.attn.{p}" for p in "qkv")}
    else:
        matrices = {f"{src}.attn_{p}.weight": (f"{dest}.attn.{p}",) for p in "qkv"}
    matrices[f"{src}.attn_output.weight"] = (f"{dest}.attn.o",)
    if arch == "gpt2":
        mlp = {"up": ("up",), "down": ("down",)}
    elif arch == "phi3" and f"{src}.ffn_gate.weight" not in names:
        mlp = {"up": ("gate", "up"), "down": ("down",)}
    else:
        mlp = {"gate": ("gate",), "up": ("up",), "down": ("down",)}
    for tensor, parts in mlp.items():
        matrices[f"{src}.ffn_{tensor}.weight"] = tuple(f"{dest}.mlp.{p}" for p in parts)
    return matrices


def _read_tensor(path: str | Path, tensor) -> np.ndarray:
    """One tensor, dequantized, in [out, in] order (GGUF lists dims innermost first). F16 and BF16
    widen to float32 exactly, so narrowing back to the file's dtype (to_decoder_params) is lossless.

    Read from the file rather than through the reader's memory map: pages touched through a map
    stay in this process's resident memory while the map lives, so a conversion would end up
    holding the whole file; a read holds one tensor and frees it."""
    return gguf.quants.dequantize(read_raw(path, tensor), tensor.tensor_type).astype(np.float32)


def read_raw(path: str | Path, tensor, into: np.ndarray | None = None) -> np.ndarray:
    """One tensor's bytes as the file stores them, [rows, row bytes] for a block type, read from the
    file (not through the reader's memory map, whose touched pages would stay resident beside the
    copy the caller makes of them); into `into` (a contiguous array of the tensor's size) when given."""
    if into is None:
        raw = np.fromfile(path, dtype=tensor.data.dtype, count=tensor.data.size, offset=tensor.data_offset)
        return raw.reshape(tensor.data.shape)
    target = memoryview(into.reshape(-1).view(np.uint8))
    if len(target) != tensor.n_bytes:
        raise ValueError(f"{tensor.name}: {tensor.n_bytes} bytes do not fill a buffer of {len(target)}")
    with open(path, "rb") as file:
        file.seek(tensor.data_offset)
        done = 0
        while done < len(target):  # a read may return less than asked
            count = file.readinto(target[done:])
            if not count:
                raise ValueError(f"{path} ends inside tensor {tensor.name}: the file is truncated")
            done += count
    return into.reshape(tensor.data.shape)


def _family_switches(reader: gguf.GGUFReader, arch: str, n_heads: int, d_model: int) -> dict:
    """ModelConfig's family switches (checkpoint/hf_families.py) from the file's metadata and, for
    what llama.cpp keeps in code, from llama.cpp's rules."""
    n_layers = int(_field(reader, f"{arch}.block_count"))
    context = int(_field(reader, f"{arch}.context_length"))
    window = _field(reader, f"{arch}.attention.sliding_window")
    switches: dict = {}
    if arch == "qwen2":
        switches["qkv_bias"] = True
    if arch in ("qwen3", "gemma3"):
        switches["qk_norm"] = True
    if arch in ("phi3", *GEMMA_ARCHITECTURES) and window is not None and int(window) < context:
        switches["sliding_window"] = int(window)
    if arch in GEMMA_ARCHITECTURES:
        head_dim = int(_field(reader, f"{arch}.attention.key_length", d_model // n_heads))
        switches |= dict(
            mlp_activation="gelu_tanh", embed_scale=True, post_norms=True,
            query_pre_attn_scalar=float(d_model // n_heads if n_layers == GEMMA_27B_LAYERS[arch] else head_dim),
            attn_logit_softcap=_optional_float(_field(reader, f"{arch}.attn_logit_softcapping")),
            final_logit_softcap=_optional_float(_field(reader, f"{arch}.final_logit_softcapping")),
        )
        if "sliding_window" in switches:
            sliding = (lambda i: i % 2 == 0) if arch == "gemma2" else (lambda i: (i + 1) % 6 != 0)
            switches["layer_types"] = tuple("sliding" if sliding(i) else "full" for i in range(n_layers))
        if arch == "gemma3":
            switches["rope_local_theta"] = 10000.0
    return switches


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def _rope_scaling(reader: gguf.GGUFReader, arch: str, path: str | Path) -> dict:
    """ModelConfig's rope fields. llama.cpp's converter writes Llama 3.x's scaling as the `rope_freqs`
    tensor and no scaling metadata; linear, YaRN and LongRoPE scaling come as `{arch}.rope.scaling.type`,
    which this engine does not implement, so they are refused rather than silently run unscaled."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear" and arch == "gemma3":  # Gemma 3's global layers
        return {"rope_scaling": "linear", "rope_scaling_factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
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


def gguf_tokenizer(reader: gguf.GGUFReader, path: str | Path, end_ids: tuple[int, ...] | None = None) -> Tokenizer:
    """The tokenizer the file's `tokenizer.*` metadata describes (the file must have a vocabulary);
    `end_ids`: its end_of_generation_ids, when already found."""
    kind = _field(reader, "tokenizer.ggml.model")
    if kind == "gpt2":
        hf = _byte_level_tokenizer(reader, path)
    elif kind == "llama":
        hf = _sentencepiece_tokenizer(reader, path, _field(reader, "general.architecture"))
    else:
        raise GGUFImportError(
            f"{path}: tokenizer.ggml.model={kind!r} is not supported; supported: {list(SUPPORTED_TOKENIZERS)} "
            "(byte-level BPE, SentencePiece BPE). Convert the HF folder instead (its tokenizer.json is used as is)."
        )
    return Tokenizer(
        hf,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        extra_eos_token_ids=end_of_generation_ids(reader) if end_ids is None else end_ids,
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise (so does transformers)
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")),
        add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


# Tokens that end generation by their text alone, as llama.cpp takes them (llama-vocab.cpp, its EOG
# set): converters do not always write an eot or eom id, and a chat model ends its turn with one of these.
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "</s>", "<eos>", "<turn|>", "<|tool_response>", "<end_of_utterance>",
    "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<｜end▁of▁sentence｜>", "[e~[",
})
# Fill-in-the-middle's pad, repository and file separators end generation too: the file's id, else
# the tokens of these texts.
FIM_END_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


def end_of_generation_ids(reader: gguf.GGUFReader) -> tuple[int, ...]:
    """Every id that ends generation, by llama.cpp's rule: the file's eos, eot and eom ids, its
    fill-in-the-middle separators and every token spelled as an end (END_OF_GENERATION_TEXTS), so
    that an instruct model stops at the end of its turn as it does under llama.cpp."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    by_text = {text: i for i, text in enumerate(tokens or [])}
    ids = {_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")}
    for key, texts in FIM_END_TEXTS.items():
        named = _field(reader, f"tokenizer.ggml.{key}_token_id")
        ids |= {named} if named is not None else {by_text[t] for t in texts if t in by_text}
    ids |= {by_text[t] for t in END_OF_GENERATION_TEXTS if t in by_text}
    # llama.cpp's two exceptions: where <|end|> closes a message and <|return|> or a call the answer
    # (gpt-oss, Solar Open), and where </s> is not Gemma 4's end (it has <|tool_response>).
    calls = "<|call|>" in by_text or "<|calls|>" in by_text
    if calls and ("<|return|>" in by_text or "<|flush|>" in by_text):
        ids.discard(by_text.get("<|end|>"))
    if "<|tool_response>" in by_text:
        ids.discard(by_text.get("</s>"))
    # An id outside the vocabulary is ignored, as llama.cpp ignores it.
    return tuple(sorted(int(i) for i in ids if i is not None and (tokens is None or 0 <= i < len(tokens))))


def _token_types(reader: gguf.GGUFReader, count: int) -> list[int]:
    return list(_field(reader, "tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * count))


def _byte_level_tokenizer(reader: gguf.GGUFReader, path: str | Path):
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFImportError(
            f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported (supported: "
            f"{sorted(PRE_TOKENIZERS)}). Convert the HF folder instead (its tokenizer.json is used as is)."
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = _token_types(reader, len(tokens))
    # Matched whole in a prompt, as llama.cpp does: control tokens, and user-defined ones (which the
    # converter writes as text, not in bytes)
    return byte_level_bpe(
        tokens, _field(reader, "tokenizer.ggml.merges", []),
        special_token_ids=[i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL],
        user_defined_ids=[i for i, t in enumerate(types) if t == gguf.TokenType.USER_DEFINED],
        split_regexes=PRE_TOKENIZERS[pre], ignore_merges=pre in IGNORE_MERGES)


def _sentencepiece_tokenizer(reader: gguf.GGUFReader, path: str | Path, arch: str):
    """A GGUF holds a SentencePiece model's pieces, scores and token types but not its normalizer, so
    what the file does not say is decided by architecture, as transformers' GGUF loader does:
    Gemma's merges are ranked by the pieces' order in the file (Gemma's scores do not follow its merge
    order), and llama.cpp's converter writes its whitespace-run tokens ("▁▁", ...) with real spaces,
    which are spelled back as pieces here.
    The space prefix follows the file's `add_space_prefix` (when absent: on, except for Gemma) and goes
    where llama.cpp puts it: before every stretch of text between the tokens matched whole, also before one that
    starts with a space (sentencepiece_bpe says why); transformers ignores the flag, and puts the prefix
    only before the first word for Llama and Mistral."""
    file_tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = _token_types(reader, len(file_tokens))
    gemma = arch in GEMMA_ARCHITECTURES
    tokens = [SPACE * len(t) if gemma and " " in t and not t.strip() else t for t in file_tokens]
    merges = _field(reader, "tokenizer.ggml.merges")
    if merges is not None:
        merges = [tuple(m.split(" ", 1)) for m in merges]
    elif gemma:
        merges = merges_from_vocab(tokens, [-i for i in range(len(tokens))])
    else:
        scores = _field(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise GGUFImportError(f"{path}: a SentencePiece vocabulary needs tokenizer.ggml.scores or "
                                  "tokenizer.ggml.merges, and the file has neither")
        merges = merges_from_vocab(tokens, scores)
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    if unk is None or not 0 <= unk < len(tokens):
        unk = next((i for i, t in enumerate(types) if t == gguf.TokenType.UNKNOWN), None)
    # Matched whole in a prompt: the control tokens and the file's named ones (as transformers and
    # llama.cpp, which parses special tokens in a prompt, do).
    named = [_field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "unknown", "padding")]
    special = {i for i, t in enumerate(types) if t in (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN)}
    special |= {i for i in named if i is not None and 0 <= i < len(tokens)}
    return sentencepiece_bpe(
        tokens, merges,
        special_token_ids=sorted(special),
        # a whitespace run spelled back as pieces is left to the merges
        user_defined_ids=[i for i, t in enumerate(types)
                          if t == gguf.TokenType.USER_DEFINED and tokens[i] == file_tokens[i]],
        unk_token_id=unk,
        space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", not gemma)),
    )
