"""speculative_config (vLLM's shape): TOML table, --speculative-config, LLM(...), and its refusals."""

import argparse
import json

import pytest

from orca_jax.cli import add_engine_args, engine_config
from orca_jax.config import ConfigError, EngineConfig, SpeculativeConfig, from_dict, load_toml


def test_toml_table_and_flag_over_it(tmp_path):
    config = tmp_path / "engine.toml"
    config.write_text('[speculative_config]\nmethod = "ngram"\nnum_speculative_tokens = 3\n')
    assert load_toml(EngineConfig, config).speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert EngineConfig().speculative_config is None  # off unless asked for
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    merged = engine_config(parser.parse_args(["--config", str(config), "--speculative-config", '{"prompt_lookup_max": 5}']))
    assert merged.speculative_config == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5)
    alone = engine_config(parser.parse_args(["--speculative-config", '{"method": "ngram"}']))
    assert alone.speculative_config == SpeculativeConfig()


@pytest.mark.parametrize("bad, field", [
    ({"method": "eagle"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 4}, "prompt_lookup_min"),
    ({"method": "draft_model"}, "model"),
    ({"method": "ngram", "model": "tiny"}, "model"),
    ({"lookahead": 2}, "lookahead"),
])
def test_bad_configs_are_refused_naming_the_field(bad, field):
    with pytest.raises(ConfigError, match=field):
        from_dict(SpeculativeConfig, bad, "--speculative-config")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(ConfigError, match=field):
        engine_config(parser.parse_args(["--speculative-config", json.dumps(bad)]))


def test_draft_model_is_refused_at_build_until_it_exists():
    from orca_jax.runner.builder import proposer_of

    config = EngineConfig(speculative_config=SpeculativeConfig(method="draft_model", model="tiny"))
    with pytest.raises(ConfigError, match="draft_model.*not implemented"):
        proposer_of(config)


def test_llm_takes_the_dict():
    """LLM(speculative_config={...}) checks it as the TOML table is, before building anything."""
    from orca_jax import LLM

    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM("tiny", speculative_config={"num_speculative_tokens": -1}, show_progress=False)
