"""Each engine setting is declared once (config.setting); its CLI flag, `LLM` keyword and TOML key are
derived from that declaration (engine_args.py). These tests fail when one of the three exists without
the others, or when one of them sets another field than the declaration says."""

import argparse
import dataclasses
import inspect
import json
import typing

import pytest

from orca_jax import LLM
from orca_jax.cli import add_engine_args, engine_config
from orca_jax.config import DEFAULT_MODEL, EngineConfig, from_dict, load_toml, presets, setting
from orca_jax.engine_args import SETTINGS, Setting, _choices, _declared, config_from_keywords

# LLM's own keywords, which are not engine settings.
LLM_BUILD_KEYWORDS = {"model", "token_buckets", "seq_buckets", "show_progress", "config", "distributed"}


def sample(hint, default, unit):
    """A valid value other than the default, for a setting of this type."""
    choices = _choices(hint)
    if choices:
        return next(c for c in choices if c != default)
    kinds = (hint, *typing.get_args(hint))
    if bool in kinds:
        return not default
    if int in kinds:
        return 64 if default is None else default + 1
    if float in kinds:
        return default / 2
    return "some-name"


def sample_of(s: Setting):
    if s.table_class is None:
        return sample(s.hint, s.default, s.unit)
    # A section given whole: one of its keys changed (the first whose change is valid on its own).
    hints = typing.get_type_hints(s.table_class)
    for f in dataclasses.fields(s.table_class):
        change = {f.name: sample(hints[f.name], f.default, f.metadata.get("unit"))}
        try:
            from_dict(s.table_class, change, "sample")
        except ValueError:
            continue
        return change
    raise AssertionError(f"no valid change of {s.table_class.__name__}")


def toml_value(value) -> str:
    return json.dumps(value)  # the JSON of a str, int, float or bool is its TOML


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def flat(config: EngineConfig) -> dict:
    """Every setting's value, by its TOML key."""
    return {s.toml_key: getattr(config if s.section is None else getattr(config, s.section), s.name) for s in SETTINGS}


class Built(Exception):
    """Raised in place of building the engine: LLM's keywords checked and turned into a config."""


@pytest.fixture
def llm_config(monkeypatch):
    """LLM(...)'s EngineConfig, through LLM.__init__ itself, stopped before anything loads."""
    from orca_jax.runner import builder

    def capture(config, *args, **kwargs):
        raise Built(config)

    monkeypatch.setattr(builder, "build_engine", capture)

    def run(*args, **kwargs) -> EngineConfig:
        with pytest.raises(Built) as built:
            LLM(*args, **kwargs)
        return built.value.args[0]

    return run


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: s.toml_key)
def test_each_setting_is_one_flag_one_llm_keyword_and_one_toml_key_that_set_the_same_field(s, tmp_path, llm_config):
    value = sample_of(s)
    # The command line.
    if s.hint is bool:
        argv = [s.flag if value else "--no-" + s.flag.removeprefix("--")]
    else:
        argv = [s.flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    from_flag = engine_config(engine_parser().parse_args(argv))
    # A TOML file.
    if s.table_class is not None:
        text = f"[{s.name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in value.items())
    else:
        text = (f"[{s.section}]\n" if s.section else "") + f"{s.name} = {toml_value(value)}\n"
    (tmp_path / "engine.toml").write_text(text)
    from_toml = load_toml(EngineConfig, tmp_path / "engine.toml")
    # LLM(...).
    from_keyword = llm_config(value) if s.keyword == "model" else llm_config(**{s.keyword: value})

    assert from_flag == from_toml == from_keyword, f"{s.flag}, {s.toml_key} and LLM({s.keyword}=) differ"
    expected = from_dict(s.table_class, value, "sample") if s.table_class else value
    changed = {key: v for key, v in flat(from_toml).items() if v != flat(EngineConfig())[key]}
    assert changed == {s.toml_key: expected}, f"{s.toml_key} set {changed}"


def test_the_flags_keywords_and_toml_keys_are_exactly_the_declared_settings():
    """Nothing spelled by hand beside the declaration: no engine flag, LLM keyword or TOML key that
    is not a declared setting, and no two settings spelled alike."""
    for spelling in ("name", "flag", "keyword"):
        names = [getattr(s, spelling) for s in SETTINGS]
        assert len(names) == len(set(names)), f"two settings share a {spelling}: {names}"
    # The engine flags of `orca-jax serve` and `generate` (--config names a file, not a setting).
    (group,) = [g for g in engine_parser()._action_groups if g.title.startswith("engine")]
    flags = {option: action.dest for action in group._group_actions for option in action.option_strings
             if not option.startswith("--no-")}
    assert flags == {"--config": "config", **{s.flag: s.name for s in SETTINGS}}
    # LLM's keywords, as help(LLM) and inspect show them (each with its declared default).
    keywords = set(inspect.signature(LLM).parameters) - LLM_BUILD_KEYWORDS
    assert keywords == {s.keyword for s in SETTINGS} - {"model"}
    for name, parameter in inspect.signature(LLM).parameters.items():
        if name in keywords:
            assert parameter.default == next(s.default for s in SETTINGS if s.keyword == name)
    # The TOML keys: every field of EngineConfig and of its plain sections (the tables that are no
    # setting themselves) is a setting.
    top = {f.name for f in dataclasses.fields(EngineConfig)}
    plain_sections = top - {s.name for s in SETTINGS if s.section is None}
    toml_keys = top - plain_sections
    for section in plain_sections:
        toml_keys |= {f"{section}.{f.name}" for f in dataclasses.fields(getattr(EngineConfig(), section))}
    assert toml_keys == {s.toml_key for s in SETTINGS}


def test_a_field_not_declared_as_a_setting_is_refused_by_name():
    @dataclasses.dataclass(frozen=True)
    class Bare:
        declared: int = setting(1, "a declared setting", unit="tokens")
        bare: int = 2

    @dataclasses.dataclass(frozen=True)
    class Undescribed:
        undescribed: int = setting(3)

    for section in (Bare, Undescribed):
        config = dataclasses.make_dataclass("Config", [("section", section, dataclasses.field(default_factory=section))])
        with pytest.raises(TypeError, match=rf"{section.__name__}\.\w+ is not declared as an engine setting"):
            _declared(config, None)


def test_an_unknown_llm_keyword_is_named_with_its_close_matches(llm_config):
    with pytest.raises(TypeError, match=r"unknown keyword argument 'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM("tiny", max_num_seq=4)
    with pytest.raises(TypeError, match=r"unknown keyword argument 'gpu_memory_utilization'; did you mean "
                                        r"'device_memory_utilization'"):
        LLM(gpu_memory_utilization=0.5)
    with pytest.raises(TypeError, match=r"'no_such_thing'; the engine settings are \[.*'max_num_seqs'"):
        LLM(no_such_thing=1)
    assert llm_config().model == DEFAULT_MODEL  # no keyword: the declared defaults
    assert llm_config() == EngineConfig()


def test_shipped_default_toml_agrees_with_the_declared_defaults():
    """configs/engine/default.toml writes defaults out for users to copy; each value it sets must be the
    declared default (it need not list every setting)."""
    assert load_toml(EngineConfig, presets("engine") / "default.toml") == EngineConfig()


def test_a_whole_section_keyword_takes_its_dataclass_or_a_dict_checked_as_its_table(llm_config):
    from orca_jax.config import SpeculativeConfig, StructuredOutputsConfig

    spec = SpeculativeConfig(num_speculative_tokens=2)
    assert llm_config(speculative_config=spec).speculative_config is spec
    assert llm_config(speculative_config={"num_speculative_tokens": 2}).speculative_config == spec
    off = llm_config(structured_outputs_config=StructuredOutputsConfig(disable_additional_properties=False))
    assert not off.structured_outputs.disable_additional_properties
    with pytest.raises(ValueError, match=r"speculative_config: unknown key\(s\) \['nope'\]"):
        config_from_keywords(speculative_config={"nope": 1})
