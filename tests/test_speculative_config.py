"""speculative_config (vLLM's shape): TOML table, --speculative-config, LLM(...), and its refusals."""

import argparse
import json
import shutil

import pytest

from orca_jax.cli import add_engine_args, engine_config
from orca_jax.config import DEFAULT_MODEL, ConfigError, EngineConfig, SpeculativeConfig, from_dict, load_toml

from .conftest import REPO_ROOT


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


def test_a_draft_model_with_another_vocabulary_is_refused_naming_both():
    """Refused before any weight of the target is read: the draft's ids are not the target's."""
    from orca_jax import LLM

    with pytest.raises(ConfigError, match=r"speculative_config.model='tiny' \(tiny\) has a vocabulary of 66 tokens "
                                          r"but the target smollm2-135m-instruct has 49152"):
        LLM(DEFAULT_MODEL, speculative_config={"method": "draft_model", "model": "tiny"}, show_progress=False)


def test_a_draft_model_with_another_tokenizer_of_the_same_size_is_refused(tmp_path):
    from orca_jax.checkpoint.store import open_model
    from orca_jax.runner.builder import proposer_of

    tiny = REPO_ROOT / "checkpoints" / "tiny"
    other = tmp_path / "tiny-other-tokens"
    shutil.copytree(tiny, other)
    tokenizer = json.loads((tiny / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["3"], vocab["5"] = vocab["5"], vocab["3"]  # same tokens, two of them numbered the other way
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = EngineConfig(model=str(tiny), speculative_config=SpeculativeConfig(method="draft_model", model=str(other)))
    with pytest.raises(ConfigError, match=r"speculative_config.model=.*tiny-other-tokens.* has another tokenizer than "
                                          r"the target tiny .*\('3', 5\)"):
        proposer_of(config, open_model(tiny))
    same = EngineConfig(model=str(tiny), speculative_config=SpeculativeConfig(method="draft_model", model=str(tiny)))
    assert proposer_of(same, open_model(tiny)).config.name == "tiny"


def test_llm_takes_the_dict():
    """LLM(speculative_config={...}) checks it as the TOML table is, before building anything."""
    from orca_jax import LLM

    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM("tiny", speculative_config={"num_speculative_tokens": -1}, show_progress=False)
