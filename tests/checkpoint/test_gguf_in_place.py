"""A GGUF file served as it is (`LLM("model.gguf")`): no conversion, the config, tokenizer and
weights read from the file, every family's matrices served from the file's own blocks, fused tensors
(GPT-2's and Phi-3's attn_qkv, Phi-3's [gate; up] ffn_up) split into their matrices' rows.

Each family's file, written here as llama.cpp's converter writes it with Q8_0 or Q4_0 matrices, is
served in place with float32 activations (the blocks dequantized exactly in registers) and gives the
same file's float32 model's logits up to summation order: a row in the wrong matrix, a q/k
permutation not undone or a fused tensor split at the wrong row would be far off."""


import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from orca_jax.checkpoint.gguf_weights import GGUFWeights, load_gguf_model
from orca_jax.config import ConfigError, load_model_preset
from orca_jax.llm import LLM
from orca_jax.model.decoder import abstract_decoder, init_decoder
from orca_jax.model.quantization import quantize_decoder
from orca_jax.sampling_params import SamplingParams

from ..checkpoint.test_hf_families import reference, write_gguf_like_llama_cpp
from ..checkpoint.test_store import params_of
from ..model.test_kquant_serving import kquant_config, write_typed_gguf

T = gguf.GGMLQuantizationType
# Bounds of tests/model/test_quantization.py (nats): the same weights, summed in another order.
MAX_MEAN_LOGPROB_DRIFT, MAX_LOGPROB_DRIFT = 1e-4, 1e-3
IDS = [0, 5, 80, 259, 3, 260, 100, 17, 42, 200, 7, 7, 7, 150, 2, 1]


def q8_then_q4(name: str) -> T:
    """Q4_0 for the MLP's matrices, Q8_0 for the others: two block types in one file."""
    return T.Q4_0 if ".ffn_" in name else T.Q8_0


def write_gpt2_gguf(path, matrix_type: T):
    """A tiny GPT-2 as llama.cpp's converter writes one: q, k and v fused in attn_qkv (rows [q; k; v]),
    every norm and projection with its bias, learned positions, the head tied to the embedding."""
    config = load_model_preset("tiny-gpt")
    p, d = params_of(init_decoder(config, seed=6)), config.d_model
    tensors = {"token_embd.weight": p["embed.embedding"], "position_embd.weight": p["pos_embed.embedding"],
               "output_norm.weight": p["final_norm.scale"], "output_norm.bias": p["final_norm.bias"]}
    for i in range(config.n_layers):
        l, b = f"layers.{i}", f"blk.{i}"
        tensors |= {
            f"{b}.attn_norm.weight": p[f"{l}.attn_norm.scale"], f"{b}.attn_norm.bias": p[f"{l}.attn_norm.bias"],
            f"{b}.ffn_norm.weight": p[f"{l}.mlp_norm.scale"], f"{b}.ffn_norm.bias": p[f"{l}.mlp_norm.bias"],
            f"{b}.attn_qkv.weight": np.concatenate([p[f"{l}.attn.{x}.kernel"].reshape(d, -1).T for x in "qkv"]),
            f"{b}.attn_qkv.bias": np.concatenate([p[f"{l}.attn.{x}.bias"].reshape(-1) for x in "qkv"]),
            f"{b}.attn_output.weight": p[f"{l}.attn.o.kernel"].reshape(-1, d).T,
            f"{b}.attn_output.bias": p[f"{l}.attn.o.bias"],
            f"{b}.ffn_up.weight": p[f"{l}.mlp.up.kernel"].T, f"{b}.ffn_up.bias": p[f"{l}.mlp.up.bias"],
            f"{b}.ffn_down.weight": p[f"{l}.mlp.down.kernel"].T, f"{b}.ffn_down.bias": p[f"{l}.mlp.down.bias"],
        }
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(config.n_layers)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_heads)
    writer.add_layer_norm_eps(config.norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
    writer.add_token_merges([])
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, np.float32)
        if array.ndim == 2 and name != "position_embd.weight":
            writer.add_tensor(name, gguf.quants.quantize(array, matrix_type), raw_dtype=matrix_type)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_family_gguf(family: str, folder) -> tuple:
    """(the file, its number of weight matrices, the quantized formats it holds)."""
    path = folder / f"{family}.gguf"
    if family == "llama":  # Q/K rows permuted as llama.cpp's converter writes them, K-quants and others
        config = kquant_config()
        return write_typed_gguf(path, config, init_decoder(config, seed=5)), 1 + 7 * config.n_layers
    if family == "gpt2":
        return write_gpt2_gguf(path, T.Q8_0), 1 + 6 * load_model_preset("tiny-gpt").n_layers
    write_gguf_like_llama_cpp(family, path, matrix_types=q8_then_q4)
    model = load_gguf_model(path)
    tied = model.config.tie_word_embeddings
    return path, (1 if tied else 2) + 7 * model.config.n_layers


def teacher_forced_logprobs(model, ids):
    logits = nnx.jit(lambda m, i, p, s: m(i, p, s))(model, jnp.asarray(ids), jnp.arange(len(ids)),
                                                    jnp.zeros(len(ids), jnp.int32))
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gpt2"])
def test_each_familys_file_served_in_place_gives_its_float_models_logits(tmp_path, family):
    path, num_matrices = write_family_gguf(family, tmp_path)
    float_model = load_gguf_model(path)
    weights = GGUFWeights.open(path)
    served, report = quantize_decoder(abstract_decoder(weights.imported.config), "gguf", weights,
                                      activations="float32")
    # Every matrix from the file's blocks (a fused tensor counted once per matrix it holds), none widened.
    assert sum(report.kept.values()) == num_matrices and report.float_matrices == []
    # Only the small tensors were read as floats: norms, biases (and GPT-2's learned positions).
    assert weights.read and all(not name.endswith(".kernel") and name not in ("embed.embedding", "lm_head.embedding")
                                for name in weights.read)
    ids = [i % float_model.config.vocab_size for i in IDS]
    expected, got = teacher_forced_logprobs(float_model.model, ids), teacher_forced_logprobs(served, ids)
    drift = np.abs(got - expected)
    assert drift.mean() < MAX_MEAN_LOGPROB_DRIFT and drift.max() < MAX_LOGPROB_DRIFT, (drift.mean(), drift.max())


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3"])  # (Gemma fixtures break llama.cpp's rules)
def test_a_float_file_read_in_place_gives_transformers_logits(tmp_path, family):
    """The float path (`--quantization none`) reads the file's tensors per part, as the import does."""
    loaded = load_gguf_model(write_gguf_like_llama_cpp(family, tmp_path / f"{family}.gguf"))
    for prompt, hf_logits, _ in reference(family):
        logits = loaded.model(jnp.asarray(prompt), jnp.arange(len(prompt)), jnp.zeros(len(prompt), jnp.int32))
        np.testing.assert_allclose(np.asarray(logits), hf_logits, atol=1e-4, rtol=0)


def test_llm_serves_a_gguf_file_in_place_by_default_and_writes_nothing(tmp_path, monkeypatch):
    """`LLM("file.gguf")`: the file's blocks by default (as llama.cpp), float weights when asked,
    the same greedy tokens either way (float32 activations), and no file written beside the model
    or into the checkpoint folder."""
    checkpoints = tmp_path / "checkpoints"
    monkeypatch.setenv("ORCA_JAX_CHECKPOINTS", str(checkpoints))
    path = write_gguf_like_llama_cpp("phi3", tmp_path / "phi3.gguf", matrix_types=T.Q8_0)
    before = sorted(p.name for p in tmp_path.iterdir())
    prompt, _, _ = reference("phi3")[1]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for quantization in ("auto", "none"):
        llm = LLM(str(path), quantization=quantization, quantization_activations="auto" if quantization == "none"
                  else "float32", max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, kv_cache_memory=8 << 20,
                  show_progress=False)
        assert llm.runner.layout_settings()["quantization"] == ("gguf" if quantization == "auto" else "none")
        tokens[quantization] = llm.generate([{"prompt_token_ids": prompt.tolist()}], greedy,
                                            use_tqdm=False)[0].outputs[0].token_ids
    assert tokens["auto"] == tokens["none"] and len(tokens["auto"]) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not checkpoints.exists()


def test_a_missing_or_foreign_gguf_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such GGUF file"):
        LLM(str(tmp_path / "absent.gguf"), show_progress=False)
    (tmp_path / "text.gguf").write_text("not a GGUF file")
    with pytest.raises(ConfigError, match="cannot serve .*text.gguf as a GGUF model"):
        LLM(str(tmp_path / "text.gguf"), show_progress=False)


def test_plan_counts_a_gguf_file_as_served_without_reading_it(tmp_path, capsys):
    """`orca-jax plan --model file.gguf` plans the file's blocks at their own sizes, as the engine
    places them after reading them."""
    from orca_jax.cli import main
    from orca_jax.config import ParallelConfig
    from orca_jax.parallel.memory_plan import plan_memory
    from orca_jax.parallel.plan_cli import _gguf_as_served

    path, _ = write_family_gguf("phi3", tmp_path)  # fused tensors, two block types
    config, planned = _gguf_as_served(str(path), None)
    placed, _ = quantize_decoder(abstract_decoder(config), "gguf", GGUFWeights.open(path))
    plan = {name: plan_memory(config, ParallelConfig(), page_size=16, kv_cache_memory=2**20, loaded_model=model)
            for name, model in (("planned", planned), ("placed", placed), ("float", None))}
    assert plan["planned"].param_bytes == plan["placed"].param_bytes < plan["float"].param_bytes
    assert main(["plan", "--model", str(path), "--kv-cache-memory", "1MiB"]) == 0
    assert "phi3 (float32) on tp 1 x pp 1" in capsys.readouterr().out
