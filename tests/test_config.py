import dataclasses

import pytest

from orca_jax.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    load_model_preset,
    load_toml,
    model_config_to_toml,
    model_preset_names,
)

REQUIRED_PRESETS = {"tiny", "gpt2-124m", "gpt3-13b", "gpt3-175b", "smollm2-135m-instruct", "llama-3-8b", "llama-3-70b",
                    "tinyllama-1.1b"}


def test_presets_load_with_the_published_sizes():
    assert REQUIRED_PRESETS <= set(model_preset_names())
    # Parameter counts the model cards give.
    assert round(load_model_preset("gpt2-124m").num_params() / 1e6) == 124
    assert round(load_model_preset("smollm2-135m-instruct").num_params() / 1e6) == 135
    assert round(load_model_preset("gpt3-175b").num_params() / 1e9) == 175
    assert round(load_model_preset("gpt3-13b").num_params() / 1e9) == 13
    assert round(load_model_preset("llama-3-8b").num_params() / 1e8) == 80  # 8.03 B
    assert round(load_model_preset("llama-3-70b").num_params() / 1e9) == 71  # 70.6 B
    assert round(load_model_preset("tinyllama-1.1b").num_params() / 1e8) == 11  # 1.10 B


def test_unknown_key_names_key_file_and_allowed_keys(tmp_path):
    path = tmp_path / "m.toml"
    text = model_config_to_toml(load_model_preset("tiny")) + "n_layer = 3\n"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_toml(ModelConfig, path)
    message = str(err.value)
    assert "n_layer" in message and str(path) in message and "n_layers" in message


def test_unknown_key_in_nested_engine_table(tmp_path):
    path = tmp_path / "engine.toml"
    path.write_text("[cache]\npage_size = 8\npagesize = 16\n")
    with pytest.raises(ConfigError, match=r"\[cache\].*pagesize"):
        load_toml(EngineConfig, path)


def test_engine_toml_fills_nested_dataclasses(tmp_path):
    path = tmp_path / "engine.toml"
    path.write_text('attention_impl = "xla"\n[scheduler]\npolicy = "orca"\nmax_num_seqs = 4\n')
    config = load_toml(EngineConfig, path)
    assert config.attention_impl == "xla"
    assert config.scheduler == SchedulerConfig(policy="orca", max_num_seqs=4)
    assert config.cache == CacheConfig()


def test_wrong_type_and_missing_key(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(model_config_to_toml(load_model_preset("tiny")).replace("d_model = 64", 'd_model = "64"'))
    with pytest.raises(ConfigError, match="d_model.*str.*int"):
        load_toml(ModelConfig, path)
    path.write_text("\n".join(l for l in model_config_to_toml(load_model_preset("tiny")).splitlines()
                              if not l.startswith("vocab_size")))
    with pytest.raises(ConfigError, match="missing.*vocab_size"):
        load_toml(ModelConfig, path)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(architecture="gpt2"), "gpt2 uses multi-head"),
        (dict(architecture="mamba"), "choose one of"),
        (dict(d_model=0), "positive integer"),
        (dict(eos_token_id=1000), "outside the vocabulary"),
        (dict(extra_eos_token_ids=(3, 1000)), "extra_eos_token_ids \\[1000\\] are outside the vocabulary"),
        (dict(dtype="float8"), "choose one of"),
    ],
)
def test_invalid_model_values(change, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(load_model_preset("tiny"), **change)


def test_invalid_engine_values():
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        EngineConfig(cache=CacheConfig(enable_prefix_caching=True), scheduler=SchedulerConfig(policy="static"))
    with pytest.raises(ConfigError, match="choose one of"):
        SchedulerConfig(policy="fifo")
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ConfigError, match="page_size"):
        CacheConfig(page_size=0)


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match="smollm2-135m-instruct"):
        load_model_preset("llama-7b")


def test_toml_round_trip():
    config = load_model_preset("smollm2-135m-instruct")
    import tomllib

    assert ModelConfig(**tomllib.loads(model_config_to_toml(config))) == config


LLAMA3_SCALING = {"rope_scaling": "llama3", "rope_scaling_factor": 8.0, "rope_low_freq_factor": 1.0,
                  "rope_high_freq_factor": 4.0, "rope_original_max_position": 64}


def test_rope_scaling_round_trips_through_toml_and_is_validated(tmp_path):
    import dataclasses

    config = dataclasses.replace(load_model_preset("tiny"), **LLAMA3_SCALING)
    path = tmp_path / "m.toml"
    path.write_text(model_config_to_toml(config))
    assert load_toml(ModelConfig, path) == config
    assert load_toml(ModelConfig, path).rope_original_max_position == 64
    tiny = load_model_preset("tiny")
    with pytest.raises(ConfigError, match="supported ones are 'llama3', 'freq_factors' and 'linear'"):
        dataclasses.replace(tiny, **(LLAMA3_SCALING | {"rope_scaling": "yarn"}))
    with pytest.raises(ConfigError, match="needs \\['rope_original_max_position'\\]"):
        dataclasses.replace(tiny, **(LLAMA3_SCALING | {"rope_original_max_position": None}))
    with pytest.raises(ConfigError, match="set but rope_scaling is None"):
        dataclasses.replace(tiny, rope_scaling_factor=8.0)
    with pytest.raises(ConfigError, match="rope_low_freq_factor .* < rope_high_freq_factor"):
        dataclasses.replace(tiny, **(LLAMA3_SCALING | {"rope_low_freq_factor": 4.0}))


def test_rope_freq_factors_round_trip_through_toml_and_are_validated(tmp_path):
    """GGUF's per-frequency factors are a TOML array of floats; float32 values read back exactly."""
    import dataclasses

    import numpy as np

    factors = tuple(float(f) for f in np.float32([1.0, 1.0, 1.5 / 1.1, 2.7, 8.0, 8.0, 8.0, 8.0]))
    config = dataclasses.replace(load_model_preset("tiny"), rope_scaling="freq_factors", rope_freq_factors=factors)
    path = tmp_path / "m.toml"
    path.write_text(model_config_to_toml(config))
    assert load_toml(ModelConfig, path) == config
    assert "rope_freq_factors = [1.0, 1.0, " in path.read_text()
    tiny = load_model_preset("tiny")  # head_dim 16: 8 rotary pairs
    with pytest.raises(ConfigError, match="needs head_dim / 2 = 8 positive factors, got 3"):
        dataclasses.replace(tiny, rope_scaling="freq_factors", rope_freq_factors=(1.0, 2.0, 3.0))
    with pytest.raises(ConfigError, match="needs \\['rope_freq_factors'\\]"):
        dataclasses.replace(tiny, rope_scaling="freq_factors")
    with pytest.raises(ConfigError, match="\\['rope_freq_factors'\\] are set but rope_scaling is 'llama3'"):
        dataclasses.replace(tiny, **(LLAMA3_SCALING | {"rope_freq_factors": factors}))
    path.write_text(model_config_to_toml(config).replace("[1.0, 1.0,", '["a", 1.0,'))
    with pytest.raises(ConfigError, match="rope_freq_factors\\[0\\] = 'a' has type str; expected float"):
        load_toml(ModelConfig, path)


@pytest.mark.parametrize("fraction", [0, 1.2, -0.1, True, "0.9"])
def test_device_memory_utilization_must_be_a_fraction(fraction):
    with pytest.raises(ConfigError, match="device_memory_utilization must be a fraction in"):
        CacheConfig(device_memory_utilization=fraction)
