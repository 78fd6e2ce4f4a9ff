"""Importers: a model exported to GGUF / HF layouts and imported back gives the same logits.

The exports below are written independently of the importers (from the published layouts: llama.cpp
permutes Q/K rows, HF GPT-2 stores Conv1D weights [in, out] and fuses QKV), so a wrong mapping in an
importer shows up as different logits.
"""

import dataclasses
import json
import math

import gguf
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import save_file
from tokenizers import pre_tokenizers

from orca_jax.checkpoint.convert import convert
from orca_jax.checkpoint.store import load_model
from orca_jax.config import load_model_preset
from orca_jax.model.decoder import init_decoder

from .test_store import params_of
from ..model.test_rotary import permute_like_llama_cpp

SPECIALS = ["<|start|>", "<|end|>"]
BYTES = sorted(pre_tokenizers.ByteLevel.alphabet())
MERGED = ["Ġt", "he", "Ġthe"]
TOKENS = SPECIALS + BYTES + MERGED
MERGES = ["Ġ t", "h e", "Ġt he"]


def logits(model, ids):
    return logits_at(model, ids, 0)


def logits_at(model, ids, first_position):
    ids = jnp.asarray(ids)
    positions = first_position + jnp.arange(len(ids))
    out = np.asarray(model(ids, positions, jnp.zeros(len(ids), jnp.int32)))
    # NaN would pass assert_allclose against NaN (an id outside the vocabulary embeds as NaN).
    assert np.isfinite(out).all()
    return out


def llama_tensors(config, p, permute_qk):
    d = config.d_model
    out = {"token_embd.weight": p["embed.embedding"], "output_norm.weight": p["final_norm.scale"]}
    for i in range(config.n_layers):
        l = f"layers.{i}"
        q = p[f"{l}.attn.q.kernel"].reshape(d, -1).T
        k = p[f"{l}.attn.k.kernel"].reshape(d, -1).T
        if permute_qk:
            q, k = permute_like_llama_cpp(q, config.n_heads), permute_like_llama_cpp(k, config.n_kv_heads)
        out |= {
            f"blk.{i}.attn_norm.weight": p[f"{l}.attn_norm.scale"],
            f"blk.{i}.attn_q.weight": q,
            f"blk.{i}.attn_k.weight": k,
            f"blk.{i}.attn_v.weight": p[f"{l}.attn.v.kernel"].reshape(d, -1).T,
            f"blk.{i}.attn_output.weight": p[f"{l}.attn.o.kernel"].reshape(-1, d).T,
            f"blk.{i}.ffn_norm.weight": p[f"{l}.mlp_norm.scale"],
            f"blk.{i}.ffn_gate.weight": p[f"{l}.mlp.gate.kernel"].T,
            f"blk.{i}.ffn_up.weight": p[f"{l}.mlp.up.kernel"].T,
            f"blk.{i}.ffn_down.weight": p[f"{l}.mlp.down.kernel"].T,
        }
    return out


def llama_gguf_writer(path, config) -> gguf.GGUFWriter:
    """A GGUFWriter of a llama file with `config`'s shape keys written (the tokenizer and tensors are the caller's)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    return writer


def write_gguf_llama(path, config, model, *, matrix_dtype=np.float32, rope_freqs=None, rope_scaling_type=None):
    """A llama GGUF as llama.cpp's converter writes one: Q/K rows permuted, norms in F32, Llama 3.x's
    rope scaling as a `rope_freqs` tensor, other kinds as `llama.rope.scaling.type`."""
    writer = llama_gguf_writer(path, config)
    if rope_scaling_type is not None:
        writer.add_rope_scaling_type(rope_scaling_type)
        writer.add_rope_scaling_factor(4.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 2))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{% for m in messages %}<|start|>{{ m['content'] }}<|end|>{% endfor %}")
    for name, array in llama_tensors(config, params_of(model), permute_qk=True).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=matrix_dtype if array.ndim == 2 else np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tiny_config():
    return dataclasses.replace(load_model_preset("tiny"), vocab_size=len(TOKENS), bos_token_id=0, eos_token_id=1)


def test_gguf_llama_import(tmp_path):
    config = gguf_tiny_config()
    model = init_decoder(config, seed=4)
    path = write_gguf_llama(tmp_path / "model.gguf", config, model)

    loaded = load_model(convert(path, "imported", tmp_path / "out"))
    assert loaded.config == dataclasses.replace(config, name="imported", norm_eps=float(np.float32(config.norm_eps)))
    ids = [5, 80, 259, 3, 260, 100]  # 260 = the last id; 261 would be out of the vocabulary
    np.testing.assert_allclose(logits(loaded.model, ids), logits(model, ids), atol=1e-5)

    tok = loaded.tokenizer
    assert tok.encode("a the 42") == [TOKENS.index(t) for t in ("a", "Ġthe", "Ġ", "4", "2")]
    assert tok.decode(tok.encode("a the 42")) == "a the 42"
    assert tok.encode("<|start|> the<|end|>") == [0, TOKENS.index("Ġthe"), 1]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|start|>hi<|end|>"


def test_gguf_f16_weights_keep_their_dtype(tmp_path):
    config = gguf_tiny_config()
    model = init_decoder(config, seed=4)
    out = convert(write_gguf_llama(tmp_path / "model.gguf", config, model, matrix_dtype=np.float16), "f16",
                  tmp_path / "out")
    loaded = load_model(out)
    assert loaded.config.dtype == "float16"
    assert stored_dtypes(out) == {"float16"}  # the F32 norms too: the model computes in one dtype
    original, restored = params_of(model), params_of(loaded.model)
    for name in ("embed.embedding", "layers.1.mlp.down.kernel", "final_norm.scale"):
        np.testing.assert_array_equal(restored[name], original[name].astype(np.float16), err_msg=name)


def stored_dtypes(checkpoint):
    """The dtypes the orbax checkpoint holds on disk (not what loading casts them to)."""
    with ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(checkpoint / "params")
    return {str(m.dtype) for m in dict(getattr(metadata, "item_metadata", metadata)).values()}


def write_hf_folder(folder, config_json, tensors, dtype=np.float32):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_json))
    save_file({k: np.ascontiguousarray(v, dtype=dtype) for k, v in tensors.items()}, folder / "model.safetensors")


def write_hf_llama_folder(folder, config, model, dtype=np.float32, **extra_config):
    gguf_to_hf = {
        "token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }
    tensors = {}
    for name, array in llama_tensors(config, params_of(model), permute_qk=False).items():
        parts = name.split(".")
        if parts[0] == "blk":
            tensors[f"model.layers.{parts[1]}.{gguf_to_hf[parts[2]]}.weight"] = array
        else:
            tensors[f"{gguf_to_hf[parts[0]]}.weight"] = array
    write_hf_folder(folder, {
        "model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "intermediate_size": config.d_ff,
        "max_position_embeddings": config.max_position, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "tie_word_embeddings": True,
        "bos_token_id": config.bos_token_id, "eos_token_id": [config.eos_token_id],
    } | extra_config, tensors, dtype)


def test_hf_llama_import(tmp_path):
    config = load_model_preset("tiny")
    model = init_decoder(config, seed=5)
    write_hf_llama_folder(tmp_path / "hf", config, model)
    loaded = load_model(convert(tmp_path / "hf", "hf-llama", tmp_path / "out"))
    assert loaded.config == dataclasses.replace(config, name="hf-llama")
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    np.testing.assert_allclose(logits(loaded.model, ids), logits(model, ids), atol=1e-5)


@pytest.mark.parametrize("declared", [True, False], ids=["torch_dtype", "from-tensors"])
def test_hf_bfloat16_checkpoint_is_stored_as_bfloat16(tmp_path, declared):
    """No widening at import: a bf16 checkpoint stays bf16 on disk and loads bf16 by default; its
    dtype comes from torch_dtype, or, without it, from the tensors."""
    config = load_model_preset("tiny")
    model = init_decoder(config, seed=5)
    extra = {"torch_dtype": "bfloat16"} if declared else {}
    write_hf_llama_folder(tmp_path / "hf", config, model, dtype=ml_dtypes.bfloat16, **extra)
    out = convert(tmp_path / "hf", "hf-bf16", tmp_path / "out")
    assert stored_dtypes(out) == {"bfloat16"}
    loaded = load_model(out)
    assert loaded.config == dataclasses.replace(config, name="hf-bf16", dtype="bfloat16")
    original, restored = params_of(model), params_of(loaded.model)
    for name in original:
        assert restored[name].dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(restored[name], original[name].astype(ml_dtypes.bfloat16), err_msg=name)
    # Loading may still widen it (what --dtype float32 and auto on CPU do): exactly, no rounding.
    widened = params_of(load_model(out, dtype="float32").model)
    np.testing.assert_array_equal(widened["layers.0.attn.q.kernel"], restored["layers.0.attn.q.kernel"].astype(np.float32))


def test_hf_float32_checkpoint_stays_float32_and_odd_dtypes_are_refused(tmp_path):
    config = load_model_preset("tiny")
    model = init_decoder(config, seed=5)
    write_hf_llama_folder(tmp_path / "hf", config, model, torch_dtype="float32")
    out = convert(tmp_path / "hf", "hf-f32", tmp_path / "out")
    assert stored_dtypes(out) == {"float32"} and load_model(out).config.dtype == "float32"
    write_hf_llama_folder(tmp_path / "hf8", config, model, torch_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="weights in float8_e4m3fn are not supported; supported: "
                                         "\\['float32', 'bfloat16', 'float16'\\]"):
        convert(tmp_path / "hf8", "m", tmp_path / "out8")


LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_type": "llama3"}




def test_hf_llama3_rope_scaling_reaches_the_model(tmp_path):
    config = load_model_preset("tiny")  # head_dim 16, theta 1e4: wavelengths 6 to 4e4 tokens
    model = init_decoder(config, seed=7)
    write_hf_llama_folder(tmp_path / "plain", config, model)
    # Older exports name the kind `type`; both spellings mean the same.
    write_hf_llama_folder(tmp_path / "scaled", config, model, rope_scaling=LLAMA3_ROPE)
    old_spelling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"} | {"type": "llama3"}
    write_hf_llama_folder(tmp_path / "scaled-type", config, model, rope_scaling=old_spelling)
    plain = load_model(convert(tmp_path / "plain", "plain", tmp_path / "out-plain"))
    scaled = load_model(convert(tmp_path / "scaled", "scaled", tmp_path / "out-scaled"))
    scaled_type = load_model(convert(tmp_path / "scaled-type", "scaled", tmp_path / "out-scaled-type"))
    assert scaled.config == dataclasses.replace(
        config, name="scaled", rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_position=32)
    assert scaled_type.config == scaled.config
    assert plain.config.rope_scaling is None
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    # The weights are the same; only the rotary frequencies differ, which shows at long positions.
    far = logits_at(scaled.model, ids, 1000)
    assert np.abs(far - logits_at(plain.model, ids, 1000)).max() > 1e-2
    np.testing.assert_allclose(far, logits_at(scaled_type.model, ids, 1000), atol=1e-6)
    # And it is the model built from the same config directly (the scaling is in model.toml).
    direct = init_decoder(dataclasses.replace(scaled.config, name="tiny"), seed=7)
    np.testing.assert_allclose(far, logits_at(direct, ids, 1000), atol=1e-5)


@pytest.mark.parametrize("rope_scaling", [{"rope_type": "dynamic", "factor": 2.0}, {"type": "yarn", "factor": 4.0}])
def test_other_rope_scaling_kinds_are_refused(tmp_path, rope_scaling):
    config = load_model_preset("tiny")
    write_hf_llama_folder(tmp_path / "hf", config, init_decoder(config, seed=1), rope_scaling=rope_scaling)
    with pytest.raises(ValueError, match="is not supported; the supported ones are 'llama3' .* and 'linear'"):
        convert(tmp_path / "hf", "m", tmp_path / "out")


def test_linear_rope_scaling_divides_positions(tmp_path):
    config = load_model_preset("tiny")
    model = init_decoder(config, seed=1)
    write_hf_llama_folder(tmp_path / "hf", config, model, rope_scaling={"rope_type": "linear", "factor": 4.0})
    scaled = load_model(convert(tmp_path / "hf", "m", tmp_path / "out"))
    assert (scaled.config.rope_scaling, scaled.config.rope_scaling_factor) == ("linear", 4.0)
    # Positions divided by the factor: tokens at 0, 8, 20 scaled are tokens at 0, 2, 5 unscaled.
    ids, segments = jnp.asarray([3, 5, 7]), jnp.zeros(3, jnp.int32)
    scaled_logits = np.asarray(scaled.model(ids, jnp.asarray([0, 8, 20]), segments))
    np.testing.assert_allclose(scaled_logits, np.asarray(model(ids, jnp.asarray([0, 2, 5]), segments)), atol=1e-5)
    assert np.abs(scaled_logits - np.asarray(model(ids, jnp.asarray([0, 8, 20]), segments))).max() > 1e-3


def llama_cpp_rope_freqs(head_dim, theta, rope_scaling):
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors): the factors it writes
    as `rope_freqs` for rope_type llama3, transcribed branch by branch."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factor, low, high = rope_scaling["factor"], rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_gguf_llama3_rope_freqs_give_the_hf_llama3_model(tmp_path):
    """A Llama 3.x GGUF (rope_freqs tensor) and the HF folder it came from (rope_scaling llama3) are
    the same model: same logits at far positions, where the scaling matters."""
    config = gguf_tiny_config()  # head_dim 16, theta 1e4: one pair kept, one blended, six scaled
    model = init_decoder(config, seed=9)
    factors = llama_cpp_rope_freqs(config.head_dim, config.rope_theta, LLAMA3_ROPE)
    assert factors[0] == 1 and 1 < factors[1] < 8 and set(factors[2:]) == {8}
    from_gguf = load_model(convert(write_gguf_llama(tmp_path / "m.gguf", config, model, rope_freqs=factors), "g",
                                   tmp_path / "out-gguf"))
    assert from_gguf.config.rope_scaling == "freq_factors"
    assert from_gguf.config.rope_freq_factors == tuple(float(f) for f in factors)
    write_hf_llama_folder(tmp_path / "hf", config, model, rope_scaling=LLAMA3_ROPE)
    from_hf = load_model(convert(tmp_path / "hf", "h", tmp_path / "out-hf"))
    ids = [5, 80, 259, 3, 260, 100]  # 260 = the last id; 261 would be out of the vocabulary
    far = logits_at(from_gguf.model, ids, 1000)
    np.testing.assert_allclose(far, logits_at(from_hf.model, ids, 1000), atol=1e-5)
    plain = load_model(convert(write_gguf_llama(tmp_path / "p.gguf", config, model), "p", tmp_path / "out-plain"))
    assert np.abs(far - logits_at(plain.model, ids, 1000)).max() > 1e-2  # the factors are applied


@pytest.mark.parametrize("kind", [gguf.RopeScalingType.LINEAR, gguf.RopeScalingType.YARN])
def test_gguf_rope_scaling_kinds_not_implemented_are_refused(tmp_path, kind):
    config = gguf_tiny_config()
    path = write_gguf_llama(tmp_path / "m.gguf", config, init_decoder(config, seed=1), rope_scaling_type=kind)
    with pytest.raises(ValueError, match=f"rope scaling type '{kind.value}' \\(llama.rope.scaling.type\\) is not "
                                         "supported; supported: plain RoPE and Llama 3.x frequency factors"):
        convert(path, "m", tmp_path / "out")


def test_hf_gpt2_import(tmp_path):
    config = load_model_preset("tiny-gpt")
    model = init_decoder(config, seed=6)
    p, d = params_of(model), config.d_model
    tensors = {"wte.weight": p["embed.embedding"], "wpe.weight": p["pos_embed.embedding"],
               "ln_f.weight": p["final_norm.scale"], "ln_f.bias": p["final_norm.bias"]}
    for i in range(config.n_layers):
        l, h = f"layers.{i}", f"h.{i}"
        tensors |= {
            f"{h}.ln_1.weight": p[f"{l}.attn_norm.scale"], f"{h}.ln_1.bias": p[f"{l}.attn_norm.bias"],
            f"{h}.ln_2.weight": p[f"{l}.mlp_norm.scale"], f"{h}.ln_2.bias": p[f"{l}.mlp_norm.bias"],
            # Conv1D: [in, out], Q, K and V fused along out.
            f"{h}.attn.c_attn.weight": np.concatenate([p[f"{l}.attn.{x}.kernel"].reshape(d, -1) for x in "qkv"], 1),
            f"{h}.attn.c_attn.bias": np.concatenate([p[f"{l}.attn.{x}.bias"].reshape(-1) for x in "qkv"]),
            f"{h}.attn.c_proj.weight": p[f"{l}.attn.o.kernel"].reshape(-1, d),
            f"{h}.attn.c_proj.bias": p[f"{l}.attn.o.bias"],
            f"{h}.mlp.c_fc.weight": p[f"{l}.mlp.up.kernel"], f"{h}.mlp.c_fc.bias": p[f"{l}.mlp.up.bias"],
            f"{h}.mlp.c_proj.weight": p[f"{l}.mlp.down.kernel"], f"{h}.mlp.c_proj.bias": p[f"{l}.mlp.down.bias"],
            f"{h}.attn.bias": np.tril(np.ones((1, 1, 8, 8))),  # a causal-mask buffer old exports carry
        }
    write_hf_folder(tmp_path / "hf", {
        "model_type": "gpt2", "vocab_size": config.vocab_size, "n_embd": d, "n_layer": config.n_layers,
        "n_head": config.n_heads, "n_inner": config.d_ff, "n_positions": config.max_position,
        "layer_norm_epsilon": config.norm_eps, "activation_function": "gelu_new",
    }, tensors)
    loaded = load_model(convert(tmp_path / "hf", "hf-gpt2", tmp_path / "out"))
    assert loaded.config == dataclasses.replace(config, name="hf-gpt2")
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    np.testing.assert_allclose(logits(loaded.model, ids), logits(model, ids), atol=1e-5)


def test_unsupported_sources_are_named(tmp_path):
    write_hf_folder(tmp_path / "hf", {"model_type": "mamba"}, {"x": np.zeros(2)})
    with pytest.raises(ValueError, match="model_type 'mamba' is not supported"):
        convert(tmp_path / "hf", "m", tmp_path / "out")
    with pytest.raises(Exception, match="does not exist"):
        convert(tmp_path / "missing.bin", "m", tmp_path / "out")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(Exception, match="neither a .gguf file nor"):
        convert(tmp_path / "weights.bin", "m", tmp_path / "out")


def test_a_tensor_of_a_layer_the_config_lacks_is_refused(tmp_path):
    """Import goes layer by layer over the config's layers: a tensor of any other layer would never be
    read, so it is refused by name rather than dropped."""
    config = load_model_preset("tiny")
    write_hf_llama_folder(tmp_path / "hf", config, init_decoder(config, seed=5))
    save_file({"model.layers.7.input_layernorm.weight": np.ones(config.d_model, np.float32)},
              tmp_path / "hf" / "model-extra.safetensors")
    with pytest.raises(ValueError, match="'blk.7.attn_norm.weight' is for layer 7, but the model has 2 layers"):
        convert(tmp_path / "hf", "m", tmp_path / "out")
    assert not (tmp_path / "out").exists()
