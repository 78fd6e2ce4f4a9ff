"""The engine settings as the command line and `LLM(...)` take them, derived from their one
declaration: the fields declared with config.setting() in EngineConfig and its sections.

Each setting is one CLI flag (vLLM's spelling where the declaration gives it), one `LLM` keyword
and one TOML key (its field, in its section's table; config.from_dict reads those). Adding a
setting is adding its field; tests/test_engine_args.py fails when the three drift apart.
This module does not import jax.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import typing
from typing import Any, Literal

from orca_jax.config import EngineConfig, from_dict
from orca_jax.sizes import byte_size


@dataclasses.dataclass(frozen=True)
class Setting:
    section: str | None  # the EngineConfig field holding it ("cache"), None at the top level
    name: str  # its field: the TOML key, in the section's [table]
    hint: Any  # the field's type
    default: Any
    description: str
    unit: str | None
    flag: str  # --max-num-seqs
    keyword: str  # LLM's max_num_seqs
    table_class: type | None  # a section given whole (JSON flag, dict keyword): its dataclass

    @property
    def toml_key(self) -> str:
        return self.name if self.section is None else f"{self.section}.{self.name}"


def _section_class(hint: Any) -> type | None:
    """The dataclass of a section field (`SpeculativeConfig | None` included), else None."""
    classes = [k for k in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(k)]
    return classes[0] if classes else None


def _declared(cls: type, section: str | None) -> list[Setting]:
    hints, found = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        table_class = _section_class(hints[f.name])
        if table_class is not None and not f.metadata:
            found += _declared(table_class, f.name)  # a plain section: each of its fields is a setting
            continue
        if not f.metadata.get("description"):
            raise TypeError(f"{cls.__name__}.{f.name} is not declared as an engine setting: write it as "
                            "config.setting(default, description, unit=...), so that its flag, LLM keyword and "
                            "TOML key exist together")
        meta = f.metadata
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        found.append(Setting(section, f.name, hints[f.name], default, meta["description"], meta["unit"],
                             meta["flag"] or "--" + f.name.replace("_", "-"), meta["keyword"] or f.name, table_class))
    return found


SETTINGS: tuple[Setting, ...] = tuple(_declared(EngineConfig, None))
BY_KEYWORD: dict[str, Setting] = {s.keyword: s for s in SETTINGS}


def config_with(base: EngineConfig, values: dict[Setting, Any], spelled: str = "keyword") -> EngineConfig:
    """`base` with the given settings replaced (each checked by its dataclass, as a TOML file's are).
    A section given whole may be its dataclass or a dict of its keys, laid over the base's own and
    checked as its TOML table is; errors name the setting as `spelled` ("keyword" or "flag")."""
    top, sections = {}, {}
    for s, value in values.items():
        if s.table_class is not None and isinstance(value, dict):
            current = getattr(base, s.name)
            merged = {**(dataclasses.asdict(current) if current is not None else {}), **value}
            value = from_dict(s.table_class, merged, getattr(s, spelled))
        if s.section is None:
            top[s.name] = value
        else:
            sections.setdefault(s.section, {})[s.name] = value
    for section, fields in sections.items():
        top[section] = dataclasses.replace(getattr(base, section), **fields)
    return dataclasses.replace(base, **top)


# The command line


def add_engine_flags(group) -> None:
    """One flag per setting. Each defaults to None, "not given", so a --config file's value stays."""
    for s in SETTINGS:
        options: dict[str, Any] = {"dest": s.name, "help": _flag_help(s)}
        choices = _choices(s.hint)
        if s.table_class is not None:
            options.update(type=json_object_arg, metavar="JSON")
        elif s.hint is bool:
            options.update(action=argparse.BooleanOptionalAction, default=None)
        elif choices:
            options.update(choices=choices)
        else:
            kind = next(k for k in (s.hint, *typing.get_args(s.hint)) if k in (int, float, str))
            options.update(type=byte_size if s.unit == "bytes" else kind)
            if s.unit:
                options["metavar"] = s.unit.upper()
        group.add_argument(s.flag, **options)


def config_from_flags(base: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """`base` (the --config file's, or the defaults) with every flag given laid over it."""
    given = {s: getattr(args, s.name) for s in SETTINGS if getattr(args, s.name) is not None}
    return config_with(base, given, spelled="flag")


def _flag_help(s: Setting) -> str:
    text = s.description
    if s.default is not None and s.table_class is None and s.hint is not bool:
        text += f" (default {s.default})"
    elif s.hint is bool:
        text += f" (default {'on' if s.default else 'off'})"
    return text.replace("%", "%%")  # argparse formats help strings with %


def _choices(hint: Any) -> tuple[str, ...] | None:
    for kind in (hint, *typing.get_args(hint)):
        if typing.get_origin(kind) is Literal:
            return typing.get_args(kind)
    return None


def json_object_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


# LLM(...)


def config_from_keywords(**keywords) -> EngineConfig:
    """The EngineConfig of `LLM(model, **keywords)` (the defaults for what is not given; the tests
    build runners' settings with it too); an unknown keyword is a TypeError naming its close matches."""
    check_keywords(keywords)
    values = {BY_KEYWORD[k]: v for k, v in keywords.items()}
    if "model" in keywords:
        values[BY_KEYWORD["model"]] = str(keywords["model"])  # a Path too
    return config_with(EngineConfig(), values)


def check_keywords(keywords: dict[str, Any], others: tuple[str, ...] = ()) -> None:
    for name in keywords:
        if name not in BY_KEYWORD:
            close = difflib.get_close_matches(name, [*BY_KEYWORD, *others], n=3)
            if close:
                hint = f"did you mean {' or '.join(map(repr, close))}? (every engine setting: docs/configuration.md)"
            else:
                hint = f"the engine settings are {sorted(BY_KEYWORD)}"
            raise TypeError(f"LLM() got an unknown keyword argument {name!r}; {hint}")


def llm_signature(init) -> inspect.Signature:
    """LLM.__init__'s own parameters with every engine keyword in the place of its **engine_args, so
    help(LLM), inspect.signature and notebooks list each setting with its default."""
    own = inspect.signature(init).parameters.values()
    positional = [p for p in own if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]  # self, model
    keyword_only = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
    engine = [inspect.Parameter(s.keyword, inspect.Parameter.KEYWORD_ONLY, default=s.default, annotation=s.hint)
              for s in SETTINGS if s.keyword not in {p.name for p in positional}]
    return inspect.Signature(positional + engine + keyword_only)
