"""Writes a GGUF file of a real model's shapes with random blocks: what a user's 8B file costs to load
and serve (start-up, memory, decode speed), without downloading one. The outputs mean nothing; both
engines compute the same function of the same bytes, so their greedy tokens can be compared.

    python bench/write_random_gguf.py OUT.gguf [--shape llama-3-8b] [--type Q4_0]

Shapes are the presets of configs/models/ (llama-3-8b: 32 layers, d 4096, ffn 14336, 8 KV heads,
vocabulary 128256: a 4.3 GB Q4_0 file). Norms are F32 ones; every matrix takes `--type` (Q4_0 or
Q8_0), its scales small and finite so activations stay in range.
"""
import argparse
from pathlib import Path

import gguf
import numpy as np

from orca_jax.config import load_model_preset

BLOCK = {"Q4_0": (32, 18), "Q8_0": (32, 34)}  # weights and bytes per block; the scale d is the first 2 bytes


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level BPE spelling of the 256 bytes (printable ones as themselves, the others
    shifted past 255), the alphabet llama.cpp's byte-level vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted, spelled = 0, {}
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + shifted)
            shifted += 1
    return [spelled[b] for b in range(256)]


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str) -> np.ndarray:
    weights, nbytes = BLOCK[qtype]
    blocks = rng.integers(0, 256, (rows, cols // weights, nbytes), np.uint8)
    # d ~ 1/sqrt(cols) / 8: each output's variance stays near its input's
    scale = np.float16(1.0 / np.sqrt(cols) / 8)
    blocks[..., :2] = np.frombuffer(scale.tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="llama-3-8b", help="a model preset of configs/models/")
    parser.add_argument("--type", default="Q4_0", choices=sorted(BLOCK))
    args = parser.parse_args()
    c = load_model_preset(args.shape)
    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[args.type]
    writer = gguf.GGUFWriter(str(args.out), "llama")
    writer.add_name(f"random {args.shape} {args.type}")
    writer.add_block_count(c.n_layers)
    writer.add_context_length(c.max_position)
    writer.add_embedding_length(c.d_model)
    writer.add_feed_forward_length(c.d_ff)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    # A byte-level BPE vocabulary of the model's size that llama.cpp loads too: the 256 byte tokens
    # (GPT-2's byte-to-character table), a token and a merge for each pair of lowercase letters, then
    # placeholders
    tokens = byte_level_alphabet()
    letters = "abcdefghijklmnopqrstuvwxyz"
    merges = [f"{a} {b}" for a in letters for b in letters]
    tokens += [a + b for a in letters for b in letters]
    tokens += [f"<tok{i}>" for i in range(len(tokens), c.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * c.vocab_size)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim

    def matrix(name: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, random_blocks(rng, rows, cols, args.type), raw_dtype=qtype)

    matrix("token_embd.weight", c.vocab_size, c.d_model)
    for i in range(c.n_layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(c.d_model, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(c.d_model, np.float32))
        matrix(f"blk.{i}.attn_q.weight", q_rows, c.d_model)
        matrix(f"blk.{i}.attn_k.weight", kv_rows, c.d_model)
        matrix(f"blk.{i}.attn_v.weight", kv_rows, c.d_model)
        matrix(f"blk.{i}.attn_output.weight", c.d_model, q_rows)
        matrix(f"blk.{i}.ffn_gate.weight", c.d_ff, c.d_model)
        matrix(f"blk.{i}.ffn_up.weight", c.d_ff, c.d_model)
        matrix(f"blk.{i}.ffn_down.weight", c.d_model, c.d_ff)
    writer.add_tensor("output_norm.weight", np.ones(c.d_model, np.float32))
    if not c.tie_word_embeddings:
        matrix("output.weight", c.vocab_size, c.d_model)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB, {args.shape} shapes, {args.type} random blocks")


if __name__ == "__main__":
    main()
