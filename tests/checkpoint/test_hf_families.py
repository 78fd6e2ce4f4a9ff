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
    from orca_jax.config import ParallelConfig
    from orca_jax.engine.step_plan import Buckets
    from orca_jax.runner.model_runner import ModelRunner

    _, loaded = family_model
    runner = ModelRunner(loaded.model, num_pages=64, page_size=16, max_model_len=128,
                         buckets=Buckets(tokens=(16, 64), seqs=(4,)), attention_impl="auto",
                         parallel=ParallelConfig())
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
    from orca_jax.config import ParallelConfig
    from orca_jax.engine.step_plan import Buckets
    from orca_jax.runner.model_runner import ModelRunner

    loaded = load_model(convert(FIXTURES / family, f"hf-{family}", tmp_path / "checkpoint"))
    runner = ModelRunner(loaded.model, num_pages=64, page_size=16, max_model_len=128,
                         buckets=Buckets(tokens=(64,), seqs=(4,)), attention_impl="auto",
                         parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))
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
