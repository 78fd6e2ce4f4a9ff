"""Quantized SmolLM2 (`--quantization gguf` and `int8`) against the float32 model, which matches HF
transformers (tests/test_smollm2_reference.py): teacher-forced over the reference fixtures' prompts
and their 300-token float32 continuations, the quantized model with its default activations agrees
with float32's top-1 token at >= 97% of the positions (int8 weights with int8 activations, not a
default, at >= 95%), and its logprob of float32's token stays close. The GGUF blocks served are the
file's bytes, and configuration mistakes are refused with the fix."""

import json
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from orca_jax.checkpoint.gguf_import import GGUF_FILE, unpermute_llama_qk
from orca_jax.config import ConfigError, EngineConfig, ParallelConfig
from orca_jax.model.linear import FloatLinear
from orca_jax.model.quantization import quantize_decoder
from orca_jax.model.relayout import matrices
from orca_jax.parallel.memory_plan import plan_memory

# Measured over the 958 positions of tests/fixtures/smollm2_continuations.json (the three reference
# prompts, each continued by 300 float32 greedy tokens; printed with -s). Over the reference's own 133
# positions one position was 0.75% of the agreement, too coarse for a 97% bar: int8 activations read
# 0.970 there and 130 of 133 with another f32 summation order.
# - The float32 checkpoint is the same GGUF dequantized, so `gguf` with float32 activations computes the
#   very same weights: agreement 1.000, drift 0 (XLA), mean 2e-6 and max 2e-5 nats (native: f32
#   summation order only).
# - int8 re-quantizes those weights per output channel: 0.980, drift mean 0.036, max 0.33 nats.
# - int8 activations (issue 39; the default for gguf): through XLA's path (the 958-row call as one
#   prefill: dequantized activations times dequantized weights) 0.984, mean 0.029, max 0.37; with every
#   row through the native kernel (as the engine's decode steps run) 0.982, mean 0.028, max 0.39.
# - int8 weights with int8 activations (not the default): 0.969, mean 0.045, max 0.55; on an AMD Zen 2
#   (AVX2 only: XLA's own float code rounds differently there, and one activation that rounds the other
#   way at a block's quantization moves a position) 0.961, mean 0.048, max 0.78. Two quantizations of
#   every product, hence float32 activations by default for int8, and the widest bounds below.
# Every miss of the defaults is a near-tie (float32's top two logits within NEAR_TIE).
# `native` sends all rows through the native kernel (the engine does so for decode steps, up to
# NATIVE_MAX_TOKENS rows; a longer call otherwise takes XLA's dequantize-then-dot).
CASES = {  # name: (quantization, activations, all rows native); "" = the engine's default
    "gguf float32": ("gguf", "float32", False), "gguf float32 native": ("gguf", "float32", True),
    "int8": ("int8", "", False), "gguf": ("gguf", "", False), "gguf native": ("gguf", "int8", True),
    "int8 int8": ("int8", "int8", False),
}
MIN_TOP1_AGREEMENT = {"gguf float32": 0.999, "gguf float32 native": 0.999, "int8": 0.97,
                      "gguf": 0.97, "gguf native": 0.97, "int8 int8": 0.95}
MAX_MEAN_LOGPROB_DRIFT = {"gguf float32": 1e-4, "gguf float32 native": 1e-4, "int8": 0.06,
                          "gguf": 0.05, "gguf native": 0.05, "int8 int8": 0.08}  # nats
MAX_LOGPROB_DRIFT = {"gguf float32": 1e-3, "gguf float32 native": 1e-3, "int8": 0.4,
                     "gguf": 0.45, "gguf native": 0.45, "int8 int8": 0.9}  # nats
NEAR_TIE = 0.5  # nats between float32's top two logits


@nnx.jit
def teacher_forced_logprobs(model, ids, positions, segments):
    logits = model(ids, positions, segments)
    return logits - jnp.log(jnp.sum(jnp.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
        - logits.max(-1, keepdims=True)


@pytest.fixture(scope="module")
def fixture_batch():
    """Every reference case's prompt + its 300-token float32 continuation as one ragged batch (one
    segment per case)."""
    cases = json.loads((Path(__file__).parents[1] / "fixtures" / "smollm2_continuations.json").read_text())["cases"]
    sequences = [c["prompt_ids"] + c["continuation_ids"] for c in cases]
    ids = np.concatenate(sequences)
    positions = np.concatenate([np.arange(len(s)) for s in sequences])
    segments = np.concatenate([np.full(len(s), i) for i, s in enumerate(sequences)])
    return jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments, jnp.int32)


@pytest.fixture(scope="module")
def float32_logprobs(smollm2, fixture_batch):
    return np.asarray(teacher_forced_logprobs(smollm2.model, *fixture_batch))


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_model_agrees_with_float32(request, smollm2, case, fixture_batch, float32_logprobs):
    quantization, activations, all_native = CASES[case]
    if not activations:  # the engine's default: the session's fixture
        model = request.getfixturevalue(f"smollm2_{quantization}").model
    else:
        model = quantize_decoder(smollm2.model, quantization, smollm2.path, activations=activations,
                                 native_max_tokens=1 << 20 if all_native else None)[0]
    got = np.asarray(teacher_forced_logprobs(model, *fixture_batch))
    want_top1 = float32_logprobs.argmax(-1)
    agreement = float(np.mean(got.argmax(-1) == want_top1))
    rows = np.arange(len(want_top1))
    drift = np.abs(got[rows, want_top1] - float32_logprobs[rows, want_top1])
    top2 = np.sort(float32_logprobs, axis=-1)[:, -2:]
    margins = (top2[:, 1] - top2[:, 0])[got.argmax(-1) != want_top1]
    print(f"{case}: top-1 agreement {agreement:.3f} over {len(rows)} positions (misses at float32 margins up to "
          f"{margins.max(initial=0):.2f} nats), logprob drift mean {drift.mean():.2e} max {drift.max():.2e} nats")
    assert agreement >= MIN_TOP1_AGREEMENT[case], agreement
    assert case == "int8 int8" or (margins < NEAR_TIE).all(), margins
    assert drift.mean() <= MAX_MEAN_LOGPROB_DRIFT[case], drift.mean()
    assert drift.max() <= MAX_LOGPROB_DRIFT[case], drift.max()


def test_gguf_serves_the_files_own_blocks(smollm2, smollm2_gguf):
    tensors = {t.name: t for t in gguf.GGUFReader(str(smollm2.path / GGUF_FILE)).tensors}
    layer = smollm2_gguf.model.layers[3]
    assert layer.mlp.down.method.format == "q4_1" and smollm2_gguf.model.embed.method.format == "q8_0"
    np.testing.assert_array_equal(np.asarray(layer.mlp.down.kernel[...]), tensors["blk.3.ffn_down.weight"].data)
    np.testing.assert_array_equal(np.asarray(smollm2_gguf.model.embed.embedding[...]), tensors["token_embd.weight"].data)
    # Q rows in the half-split RoPE order the float checkpoint uses: the same weights once dequantized.
    q_rows = unpermute_llama_qk(tensors["blk.3.attn_q.weight"].data, smollm2.config.n_heads)
    np.testing.assert_array_equal(np.asarray(layer.attn.q.kernel[...]), q_rows)
    float_q = np.asarray(smollm2.model.layers[3].attn.q.kernel[...]).reshape(576, -1).T
    np.testing.assert_array_equal(gguf.quants.dequantize(q_rows, gguf.GGMLQuantizationType.Q4_1), float_q)
    # The float model the fixture holds is left as it was.
    assert smollm2.model.layers[3].mlp.down.method == FloatLinear()


def test_int8_scales_are_per_output_channel(smollm2, smollm2_int8):
    up = smollm2_int8.model.layers[0].mlp.up
    w = np.asarray(smollm2.model.layers[0].mlp.up.kernel[...]).T  # [out 1536, in 576]
    np.testing.assert_array_equal(np.asarray(up.scales[...]), np.abs(w).max(axis=1) / np.float32(127))
    assert up.kernel[...].dtype == jnp.int8 and up.kernel[...].shape == (1536, 576)


def test_gguf_without_the_file_names_the_pull_to_run(smollm2, tmp_path):
    with pytest.raises(ConfigError, match="orca-jax pull --force smollm2-135m-instruct"):
        quantize_decoder(smollm2.model, "gguf", tmp_path)


def test_bad_quantization_settings_are_refused():
    with pytest.raises(ConfigError, match=r"quantization=.q4.; choose one of \[.auto., .none., .gguf., .int8.\]"):
        EngineConfig(quantization="q4")
    with pytest.raises(ConfigError, match="use tensor_parallel_size=1"):
        EngineConfig(quantization="int8", parallel=ParallelConfig(tensor_parallel_size=3))
    # auto is gguf for a .gguf file: its blocks are not split over devices either; a checkpoint's is none
    with pytest.raises(ConfigError, match=r"quantization='gguf' \(auto's choice for a .gguf file\) keeps whole"):
        EngineConfig(model="/models/m.gguf", parallel=ParallelConfig(tensor_parallel_size=2))
    assert EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2)).effective_quantization == "none"
    assert EngineConfig(model="/models/m.gguf", quantization="none").effective_quantization == "none"
    with pytest.raises(ConfigError, match=r"quantization_activations=.int4.; choose one of \[.auto., .float32., .int8.\]"):
        EngineConfig(quantization="gguf", quantization_activations="int4")
    with pytest.raises(ConfigError, match="quantization='none' has none: set quantization='gguf' or 'int8'"):
        EngineConfig(quantization_activations="int8")
    with pytest.raises(ConfigError, match="activations must be auto, float32 or int8"):
        quantize_decoder(None, "gguf", Path("."), activations="int4")


def test_gguf_takes_int8_activations_by_default_and_float32_when_asked(smollm2, smollm2_gguf, smollm2_int8):
    """Every matrix of the quantized model computes as the setting says (int8 weights: float32 by default)."""
    asked, _ = quantize_decoder(smollm2.model, "gguf", smollm2.path, activations="float32")
    for model, want in ((smollm2_gguf.model, "int8"), (asked, "float32"), (smollm2_int8.model, "float32")):
        methods = {path: module.method for path, module in matrices(model).items()}
        assert len(methods) == 7 * smollm2.config.n_layers + 1  # the layers' and the tied embedding
        assert {path: m.activations for path, m in methods.items() if m.activations != want} == {}, want


@pytest.mark.parametrize("quantization", ["gguf", "int8"])
def test_the_memory_plan_counts_quantized_matrices_at_their_own_size(request, smollm2, quantization):
    """The sizes the formats give, not the model's arrays summed again: gguf serves the file's tensors
    as they are (its float32 norms too); int8 is a byte a weight and a float32 scale a row."""
    model = request.getfixturevalue(f"smollm2_{quantization}").model
    plan = plan_memory(smollm2.config, ParallelConfig(), page_size=16, max_model_len=512, kv_cache_memory=2**26,
                       loaded_model=model)
    if quantization == "gguf":
        want = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(smollm2.path / GGUF_FILE)).tensors)
    else:
        rows = [m.rows_shape for m in matrices(smollm2.model).values()]  # (out, in) of each float matrix
        norms = (2 * smollm2.config.n_layers + 1) * smollm2.config.d_model  # float32 scales
        want = sum(out * inner + 4 * out for out, inner in rows) + 4 * norms
    assert plan.param_bytes == want
    float_plan = plan_memory(smollm2.config, ParallelConfig(), page_size=16, max_model_len=512, kv_cache_memory=2**26)
    assert plan.param_bytes < float_plan.param_bytes / 3  # 97 / 135 MB against 538 MB of float32
