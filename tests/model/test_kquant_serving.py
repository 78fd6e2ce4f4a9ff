"""`--quantization gguf` on a K-quant file: a tiny llama written here as a `_M` GGUF would be (each
tensor in its own block type: Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0, the tied embedding Q6_K) serves each
tensor's blocks as the file holds them and gives the float32 model's answers: the checkpoint the
import makes is the same file dequantized, so only f32 summation order may differ (the bounds of
tests/model/test_quantization.py). A type with no kernel (Q2_K) is dequantized at load, said in one
line."""

import dataclasses
import logging

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from orca_jax.checkpoint.convert import convert
from orca_jax.checkpoint.gguf_import import GGUF_FILE
from orca_jax.checkpoint.store import load_model, open_model, restore_params
from orca_jax.config import ParallelConfig, load_model_preset
from orca_jax.llm import LLM, SamplingParams
from orca_jax.model.decoder import init_decoder
from orca_jax.model.quantization import quantize_decoder
from orca_jax.parallel.memory_plan import plan_memory

from ..checkpoint.test_import import MERGES, TOKENS, llama_gguf_writer, llama_tensors
from ..checkpoint.test_store import params_of
from ..kquants import QUANTIZERS, quantize_k

T = gguf.GGMLQuantizationType
# A mix as llama.cpp's Q4_K_M makes one (Q4_K most matrices, Q6_K for half the ffn_down and attn_v and
# the output), plus the fall-back types and the ones it keeps as they were.
MIXED_TYPES = {"token_embd": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q5_0, "attn_v": T.Q6_K, "attn_output": T.Q5_1,
               "ffn_gate": T.Q4_K, "ffn_up": T.Q5_K, "ffn_down": T.Q6_K}
LAYER_1_TYPES = {"ffn_down": T.Q4_K, "attn_output": T.Q8_0, "attn_k": T.Q4_0, "ffn_up": T.Q4_1}
# Bounds of tests/model/test_quantization.py (nats): the same weights, summed in another order.
MAX_MEAN_LOGPROB_DRIFT, MAX_LOGPROB_DRIFT = 1e-4, 1e-3


def kquant_config():
    # d_model and d_ff multiples of 256: K-quant rows are whole 256-weight blocks.
    return dataclasses.replace(load_model_preset("tiny"), vocab_size=len(TOKENS), d_model=256, d_ff=512, n_heads=4,
                               n_kv_heads=2, head_dim=64, max_position=256, bos_token_id=0, eos_token_id=1)


def tensor_type(name: str) -> T:
    if not name.endswith(".weight") or name.endswith("norm.weight"):
        return T.F32
    part = name.split(".")[-2]
    if name.startswith("blk.1.") and part in LAYER_1_TYPES:
        return LAYER_1_TYPES[part]
    return MIXED_TYPES[part]


def blocks_of(array: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return np.ascontiguousarray(array, np.float32)
    if qtype.name.lower() in QUANTIZERS:
        return quantize_k(array, qtype.name.lower())
    if qtype == T.Q2_K:  # no quantizer anywhere: random bytes, a small finite d and dmin last
        rows = np.random.default_rng(0).integers(0, 256, (array.shape[0], array.shape[1] // 256, 84), np.uint8)
        rows[..., 80:84] = np.array([0.01, 0.005], np.float16).view(np.uint8)
        return rows.reshape(array.shape[0], -1)
    return gguf.quants.quantize(np.asarray(array, np.float32), qtype)


def write_typed_gguf(path, config, model, type_of=tensor_type):
    """A llama GGUF (Q/K rows permuted as llama.cpp's converter writes them) whose tensors take the
    block type `type_of(name)`."""
    writer = llama_gguf_writer(path, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 2))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for name, array in llama_tensors(config, params_of(model), permute_qk=True).items():
        qtype = type_of(name)
        writer.add_tensor(name, blocks_of(np.asarray(array, np.float32), qtype),
                          raw_dtype=None if qtype == T.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def kquant_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kquant")
    config = kquant_config()
    path = write_typed_gguf(folder / "tiny-q4_k_m.gguf", config, init_decoder(config, seed=5))
    return convert(path, "tiny-q4-k-m", folder / "checkpoint")


def teacher_forced_logprobs(model, ids):
    logits = nnx.jit(lambda m, i, p, s: m(i, p, s))(model, jnp.asarray(ids), jnp.arange(len(ids)),
                                                    jnp.zeros(len(ids), jnp.int32))
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


IDS = [0, 5, 80, 259, 3, 260, 100, 17, 42, 200, 7, 7, 7, 150, 2, 1]


def test_each_tensor_keeps_its_own_block_type_and_gives_the_float_models_logits(kquant_checkpoint):
    loaded = load_model(kquant_checkpoint)
    # float32 activations: the blocks dequantized exactly, so the float model's logits to rounding
    # (int8 activations, the default, are held to the kernel's reference in tests/pallas_kernels).
    model, report = quantize_decoder(loaded.model, "gguf", kquant_checkpoint, activations="float32")
    tensors = {t.name: t for t in gguf.GGUFReader(str(kquant_checkpoint / GGUF_FILE)).tensors}
    layers = model.layers
    assert model.embed.method.format == "q6_k"  # also the tied LM head
    assert [layers[0].attn.q.method.format, layers[0].attn.k.method.format, layers[0].attn.v.method.format,
            layers[0].attn.o.method.format, layers[0].mlp.up.method.format, layers[0].mlp.down.method.format] == \
        ["q4_k", "q5_0", "q6_k", "q5_1", "q5_k", "q6_k"]
    assert [layers[1].attn.k.method.format, layers[1].attn.o.method.format, layers[1].mlp.up.method.format,
            layers[1].mlp.down.method.format] == ["q4_0", "q8_0", "q4_1", "q4_k"]
    for array, name in [(layers[0].mlp.down.kernel, "blk.0.ffn_down.weight"), (model.embed.embedding, "token_embd.weight"),
                        (layers[0].mlp.up.kernel, "blk.0.ffn_up.weight")]:
        np.testing.assert_array_equal(np.asarray(array[...]), tensors[name].data)  # the file's bytes
    assert report.float_matrices == [] and report.dequantized_types == set()
    assert report.kept == {"q4_k": 5, "q5_k": 1, "q6_k": 4, "q5_0": 1, "q5_1": 1, "q4_0": 1, "q4_1": 1, "q8_0": 1}

    want = teacher_forced_logprobs(loaded.model, IDS)
    got = teacher_forced_logprobs(model, IDS)
    drift = np.abs(got - want)
    print(f"K-quant tiny llama: logprob drift mean {drift.mean():.2e} max {drift.max():.2e} nats")
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert drift.mean() <= MAX_MEAN_LOGPROB_DRIFT and drift.max() <= MAX_LOGPROB_DRIFT

    # The memory plan counts each tensor at its own size: the kept blocks are the file's bytes, and
    # so are its float32 norms (the model's arrays summed again would agree with any layout).
    plan = plan_memory(loaded.config, ParallelConfig(), page_size=16, max_model_len=128, kv_cache_memory=2**22,
                       loaded_model=model)
    assert plan.param_bytes == sum(int(t.n_bytes) for t in tensors.values())
    file_blocks = sum(int(t.n_bytes) for t in tensors.values() if t.tensor_type != T.F32)
    assert report.quantized_bytes == file_blocks


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_quantizing_a_model_of_shapes_reads_only_the_float_parameters_it_keeps(kquant_checkpoint, quantization,
                                                                                monkeypatch):
    """The engine quantizes the model `open_model` gives (shapes only): `gguf` must never read the
    float copies of the matrices it serves from the file (a 7B Q4_K_M would need 28 GB for them),
    `int8` reads the float matrices one layer at a time; the result equals quantizing a loaded model."""
    import orca_jax.checkpoint.store as store_module

    reads = []

    def recording_restore(path, wanted):
        reads.append(sorted(wanted))
        return restore_params(path, wanted)

    monkeypatch.setattr(store_module, "restore_params", recording_restore)
    from_shapes, _ = quantize_decoder(open_model(kquant_checkpoint).model, quantization, kquant_checkpoint)
    monkeypatch.undo()
    from_arrays, _ = quantize_decoder(load_model(kquant_checkpoint).model, quantization, kquant_checkpoint)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(from_shapes)),
                 nnx.to_pure_dict(nnx.state(from_arrays)))
    read = [name for names in reads for name in names]
    matrices = [name for name in read if name.endswith((".kernel", ".embedding"))]
    assert len(read) == len(set(read))  # each parameter read once
    if quantization == "gguf":  # every matrix is served from the file: norms only
        assert matrices == [] and read and all("norm" in name for name in read), read
    else:  # the embedding, then each layer's 7 matrices, then the rest
        assert [len([n for n in names if n.endswith((".kernel", ".embedding"))]) for names in reads[:-1]] == [1, 7, 7]
        assert not any(name.endswith((".kernel", ".embedding")) for name in reads[-1])


def test_served_with_quantization_gguf_gives_the_float_models_greedy_tokens(kquant_checkpoint, capfd):
    prompts = ["a the 42", "the the"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    answers = {}
    for quantization in ("none", "gguf"):  # gguf with float32 activations: exact dequantizing
        llm = LLM(kquant_checkpoint, quantization=quantization, max_num_seqs=2, max_num_batched_tokens=32,
                  token_buckets=[32], seq_buckets=[2], kv_cache_memory=1 << 22, max_model_len=128,
                  quantization_activations="float32")
        answers[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert answers["gguf"] == answers["none"]
    assert all(len(tokens) == 12 for tokens in answers["gguf"])
    line = next(line for line in capfd.readouterr().err.splitlines() if "--quantization gguf" in line)
    assert "1 q4_0" in line and "5 q4_k" in line and "4 q6_k" in line and "float32 activations" in line, line


def test_a_type_without_a_kernel_is_dequantized_at_load_in_one_line(tmp_path, caplog):
    config = kquant_config()
    float_model = init_decoder(config, seed=6)
    q2 = lambda name: T.Q2_K if name in ("blk.0.ffn_up.weight", "blk.1.ffn_gate.weight") else tensor_type(name)  # noqa: E731
    checkpoint = convert(write_typed_gguf(tmp_path / "q2.gguf", config, float_model, type_of=q2), "q2", tmp_path / "c")
    loaded = load_model(checkpoint)
    with caplog.at_level(logging.WARNING, logger="orca_jax.model.quantization"):  # (float32: exact, as above)
        model, report = quantize_decoder(loaded.model, "gguf", checkpoint, activations="float32")
    lines = [r.getMessage() for r in caplog.records if "Q2_K" in r.getMessage()]
    assert len(lines) == 1 and "blk.0.ffn_up.weight, blk.1.ffn_gate.weight" in lines[0], lines
    assert report.dequantized_types == {"Q2_K"} and len(report.float_matrices) == 2
    assert "2 left in float (Q2_K dequantized)" in report.one_line()
    assert model.layers[0].mlp.up.method == loaded.model.layers[0].mlp.up.method  # the float method
    np.testing.assert_array_equal(np.asarray(model.layers[0].mlp.up.kernel[...]),
                                  np.asarray(loaded.model.layers[0].mlp.up.kernel[...]))
    drift = np.abs(teacher_forced_logprobs(model, IDS) - teacher_forced_logprobs(loaded.model, IDS))
    assert drift.max() <= MAX_LOGPROB_DRIFT
