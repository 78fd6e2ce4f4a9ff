"""Each supported HF family against transformers' own forward and generate (fixtures made by
tests/fixtures/hf_families/make_fixtures.py with transformers, committed): converted from the HF
folder, teacher-forced logits on a ragged batch within 1e-4, and greedy continuations equal to
transformers' under every policy, batched and alone, through the engine's paged KV (pages of 16
tokens; the prompts are 5, 17 and 40 long)."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.checkpoint.convert import convert
from orca_jax.checkpoint.store import load_model
from orca_jax.sampling_params import SamplingParams

from tests.engine.conftest import make_engine, run_all

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_families"
FAMILIES = ["qwen2", "qwen3", "phi3", "mistral", "gemma2", "gemma3_text"]
POLICIES = ["static", "orca", "paged", "chunked"]
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=64)


def reference(family: str) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """[(prompt ids, transformers' logits [L, V], its 32 greedy tokens)] per prompt."""
    data = np.load(FIXTURES / family / "reference.npz")
    count = len([k for k in data.files if k.startswith("prompt_")])
    return [(data[f"prompt_{i}"], data[f"logits_{i}"], data[f"greedy_{i}"]) for i in range(count)]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    family = request.param
    out = tmp_path_factory.mktemp(family)
    return family, load_model(convert(FIXTURES / family, f"hf-{family}", out / "checkpoint"))


@pytest.fixture(scope="module")
def family_runner(family_model):
    from orca_jax.engine.step_plan import Buckets
    from orca_jax.engine_args import config_from_keywords
    from orca_jax.runner.model_runner import ModelRunner

    _, loaded = family_model
    runner = ModelRunner(loaded.model, config_from_keywords(page_size=16), num_pages=64, max_model_len=128,
                         buckets=Buckets(tokens=(16, 64), seqs=(4,)))
    runner.warm_up(show_progress=False)
    return runner


def test_teacher_forced_logits_match_transformers(family_model):
    family, loaded = family_model
    cases = reference(family)
    # One ragged call: the prompts concatenated, kept apart by segment ids.
    ids = np.concatenate([prompt for prompt, _, _ in cases])
    positions = np.concatenate([np.arange(len(prompt)) for prompt, _, _ in cases])
    segments = np.concatenate([np.full(len(prompt), i) for i, (prompt, _, _) in enumerate(cases)])
    logits = np.asarray(loaded.model(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments)))
    expected = np.concatenate([hf_logits for _, hf_logits, _ in cases])
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 1.0  # logits with spread: a missing term would show


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_continuations_match_transformers_batched_and_alone(family_model, family_runner, policy):
    family, loaded = family_model
    cases = reference(family)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    requests = [(prompt.tolist(), greedy) for prompt, _, _ in cases]
    batched = run_all(make_engine(family_runner, loaded, policy, **LIMITS), requests)
    for (prompt, _, hf_greedy), out, one in zip(cases, batched, requests):
        assert out.outputs[0].token_ids == hf_greedy.tolist(), (family, len(prompt))
        solo = run_all(make_engine(family_runner, loaded, policy, **LIMITS), [one])[0]
        assert solo.outputs[0].token_ids == out.outputs[0].token_ids
    assert family_runner.num_compilations_after_warmup == 0


@pytest.mark.parametrize("change, named", [
    ({"model_type": "mamba"}, "model_type 'mamba' is not supported; supported: llama, qwen2, qwen3, phi3, mistral, gemma2, gemma3_text, gpt2"),
    ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=True"),
    ({"model_type": "llama", "sliding_window": 64}, "sliding_window=64"),  # phi3's folder: no use_sliding_window
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
])
def test_unsupported_families_and_fields_are_refused_by_name(tmp_path, change, named):
    import json
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(FIXTURES / ("phi3" if change.get("model_type") == "llama" else "qwen2"), folder)
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        convert(folder, "refused", tmp_path / "out")


@pytest.mark.parametrize("family, change, window", [
    ("qwen2", {"sliding_window": 64, "use_sliding_window": False}, None),  # Qwen2.5's configs: window off
    ("phi3", {"sliding_window": 2047, "max_position_embeddings": 4096}, 2047),  # Phi-3 mini 4k's window
])
def test_windows_a_family_turns_off_or_has_are_accepted(tmp_path, family, change, window):
    import json
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(FIXTURES / family, folder)
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    assert load_model(convert(folder, "accepted", tmp_path / "out")).config.sliding_window == window


@pytest.mark.parametrize("family, tp, pp", [("qwen2", 2, 1), ("gemma3_text", 1, 2)])
def test_tensor_and_pipeline_parallel_give_transformers_tokens(tmp_path, family, tp, pp):
    """Biases sharded with their heads (qwen2 at tp 2); sliding and global layers on different
    pipeline stages (gemma3: 3 layers over 2 stages)."""
    from orca_jax.engine.step_plan import Buckets
    from orca_jax.engine_args import config_from_keywords
    from orca_jax.runner.model_runner import ModelRunner

    loaded = load_model(convert(FIXTURES / family, f"hf-{family}", tmp_path / "checkpoint"))
    settings = config_from_keywords(page_size=16, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    runner = ModelRunner(loaded.model, settings, num_pages=64, max_model_len=128,
                         buckets=Buckets(tokens=(64,), seqs=(4,)))
    runner.warm_up(show_progress=False)
    cases = reference(family)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = run_all(make_engine(runner, loaded, "chunked", **LIMITS), [(p.tolist(), greedy) for p, _, _ in cases])
    assert [o.outputs[0].token_ids for o in outputs] == [g.tolist() for _, _, g in cases]


def test_family_switches_round_trip_and_are_validated(tmp_path):
    import dataclasses

    from orca_jax.config import ConfigError, ModelConfig, load_model_preset, load_toml, model_config_to_toml

    gemma3 = load_model(convert(FIXTURES / "gemma3_text", "g3", tmp_path / "checkpoint")).config
    assert gemma3.layer_types == ("sliding", "sliding", "full") and gemma3.rope_local_theta == 1e4
    assert (gemma3.rope_scaling, gemma3.rope_scaling_factor, gemma3.rope_theta) == ("linear", 4.0, 1e6)
    (tmp_path / "m.toml").write_text(model_config_to_toml(gemma3))
    assert load_toml(ModelConfig, tmp_path / "m.toml") == gemma3
    tiny = load_model_preset("tiny")
    for change, message in [
        (dict(sliding_window=4, layer_types=("sliding",)), "one of 'sliding'/'full' per layer"),
        (dict(layer_types=("sliding", "full")), "sliding layers but sliding_window is not set"),
        (dict(sliding_window=0), "sliding_window must be >= 1"),
        (dict(attn_logit_softcap=-1.0), "attn_logit_softcap must be > 0"),
        (dict(mlp_activation="relu"), "mlp_activation"),
    ]:
        with pytest.raises(ConfigError, match=message):
            dataclasses.replace(tiny, **change)
    with pytest.raises(ConfigError, match="belong to the llama architecture"):
        dataclasses.replace(load_model_preset("tiny-gpt"), sliding_window=4)


# ---- the same families from GGUF files, written as llama.cpp's converter writes them ----

def write_gguf_like_llama_cpp(family: str, path, matrix_types=None, **metadata_overrides):
    """The HF fixture as a GGUF: llama.cpp's tensor names, Phi-3's gate/up kept fused as ffn_up,
    Gemma's norms stored as 1 + w, the architecture's metadata keys; a byte-level BPE vocabulary
    with Qwen2's pre-tokenizer. `matrix_types`: a gguf.GGMLQuantizationType, or a function of the
    tensor's name giving one, for each weight matrix (default: F32)."""
    import json

    import gguf
    from safetensors.numpy import load_file

    from orca_jax.checkpoint.hf_families import NAMES
    from orca_jax.checkpoint.hf_import import _rename

    c = json.loads((FIXTURES / family / "config.json").read_text())
    arch = {"gemma3_text": "gemma3"}.get(family, family)
    tensors = {_rename(k, NAMES[family], path): v for k, v in load_file(FIXTURES / family / "model.safetensors").items()}
    if family == "phi3":
        for i in range(c["num_hidden_layers"]):
            tensors[f"blk.{i}.ffn_up.weight"] = tensors.pop(f"blk.{i}.ffn_gate_up.weight")
    if arch.startswith("gemma"):
        tensors = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in tensors.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    writer.add_rope_freq_base(c["rope_parameters"].get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    for key, value in ({"attention.sliding_window": c.get("sliding_window")} | metadata_overrides).items():
        if value is not None:
            writer.add_uint32(f"{arch}.{key}", value) if isinstance(value, int) else writer.add_float32(f"{arch}.{key}", value)
    tokens = [f"t{i}" for i in range(c["vocab_size"])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges([])
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        qtype = None
        if matrix_types is not None and array.ndim == 2 and name.endswith(".weight"):
            qtype = matrix_types(name) if callable(matrix_types) else matrix_types
        if qtype is None or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3"])
def test_gguf_files_of_the_families_give_transformers_logits(tmp_path, family):
    loaded = load_model(convert(write_gguf_like_llama_cpp(family, tmp_path / f"{family}.gguf"), family,
                                tmp_path / "checkpoint"))
    for prompt, hf_logits, _ in reference(family):
        positions = jnp.arange(len(prompt))
        logits = loaded.model(jnp.asarray(prompt), positions, jnp.zeros(len(prompt), jnp.int32))
        np.testing.assert_allclose(np.asarray(logits), hf_logits, atol=1e-4, rtol=0)
    # Qwen2's pre-tokenizer: digits one by one, words with their leading space (Llama 3's groups 3 digits).
    pieces = [piece for piece, _ in loaded.tokenizer.hf.pre_tokenizer.pre_tokenize_str("I've 12345 apples")]
    assert pieces == ["I", "'ve", "Ġ", "1", "2", "3", "4", "5", "Ġapples"]


def test_gguf_gemma_metadata_follows_llama_cpp(tmp_path):
    """What llama.cpp keeps in code: the attention scale (1/sqrt(head_dim) but for the 27B models),
    the sliding-layer pattern, Gemma 3's local RoPE base; the soft caps from the file. (The gemma
    fixtures' own scale and 3-layer pattern differ from those rules, so no logits here.)"""
    gemma2 = load_model(convert(write_gguf_like_llama_cpp("gemma2", tmp_path / "g2.gguf", attn_logit_softcapping=2.0,
                                                          final_logit_softcapping=3.0), "g2", tmp_path / "c2")).config
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (2.0, 3.0)
    assert gemma2.layer_types == ("sliding", "full") and gemma2.query_pre_attn_scalar == 32.0
    assert gemma2.embed_scale and gemma2.post_norms and gemma2.mlp_activation == "gelu_tanh"
    gemma3 = load_model(convert(write_gguf_like_llama_cpp("gemma3_text", tmp_path / "g3.gguf"), "g3",
                                tmp_path / "c3")).config
    assert gemma3.layer_types == ("sliding",) * 3 and gemma3.rope_local_theta == 1e4 and gemma3.qk_norm


def test_the_offline_api_serves_a_family_with_layer_types(tmp_path):
    """Through LLM and the builder (the memory plan sizes a one-layer model of the family): Gemma 3's
    per-layer windows and RoPE bases, with int8 weights too (their tokens may differ from
    transformers'; the engine must build and run)."""
    from orca_jax.llm import LLM

    checkpoint = convert(FIXTURES / "gemma3_text", "g3", tmp_path / "checkpoint")
    prompt, _, hf_greedy = reference("gemma3_text")[1]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for quantization in ("none", "int8"):
        llm = LLM(str(checkpoint), quantization=quantization, max_num_seqs=4, max_num_batched_tokens=64)
        out = llm.generate([{"prompt_token_ids": prompt.tolist()}], greedy, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 32
        # Processes of one multi-host model compare it at start-up (parallel/multihost.py).
        assert llm.runner.layout_settings()["quantization"] == quantization
        if quantization == "none":
            assert out.token_ids == hf_greedy.tolist()
