"""docs/configuration.md, made from the one declaration of the engine's settings: the fields declared
with config.setting() in EngineConfig and its sections, as orca_jax/engine_args.py reads them (TOML
key, type, default, unit, flag, LLM keyword, description). The mkdocs hook (docs/hooks.py) builds the
page at each `mkdocs build`, so a setting is documented by its own declaration.

    python docs/gen_config_reference.py        # print the page
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orca_jax.engine_args import SETTINGS, Setting  # noqa: E402

# The TOML tables, in page order, and what each holds.
TABLES = {
    None: "Top-level keys of the TOML file: the model, its numerics and its kernels.",
    "cache": "The paged KV cache.",
    "scheduler": "Iteration-level scheduling ([Scheduling](scheduling.md)).",
    "parallel": "Tensor and pipeline parallelism ([Parallelism](parallelism.md)).",
}


def type_text(hint) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if type(None) in args:
        return " or ".join(type_text(a) for a in args if a is not type(None)) + " or none"
    return getattr(hint, "__name__", str(hint))


def value_text(value, unit: str | None = None) -> str:
    if value is None:
        return "none"
    if dataclasses.is_dataclass(value):
        return "(a table)"
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"`{text}`" + (f" {unit}" if unit and not isinstance(value, bool) else "")


def cell(text: str) -> str:
    return text.replace("|", "&#124;")


def describe(description: str, hint) -> str:
    """The description, then the choices of a fixed set or the type of a free value."""
    text = cell(description[:1].upper() + description[1:])
    kinds = [hint, *typing.get_args(hint)]
    choices = [typing.get_args(k) for k in kinds if typing.get_origin(k) is typing.Literal]
    if choices:
        return f"{text}. One of {', '.join(f'`{c}`' for c in choices[0])}."
    return f"{text}. Type: {type_text(hint)}."


def row(s: Setting) -> str:
    keyword = "" if s.keyword == s.name else f"<br>LLM: `{s.keyword}`"
    return f"| `{s.name}`{keyword} | `{s.flag}` | {value_text(s.default, s.unit)} | {describe(s.description, s.hint)} |"


def table_keys(s: Setting) -> list[str]:
    """The keys of a section given whole (a JSON flag, a dict keyword, a TOML table)."""
    hints = typing.get_type_hints(s.table_class)
    out = ["| key | default | description |", "|---|---|---|"]
    for f in dataclasses.fields(s.table_class):
        meta = f.metadata
        out.append(f"| `{f.name}` | {value_text(f.default, meta.get('unit'))} | "
                   f"{describe(meta.get('description', ''), hints[f.name])} |")
    return out


def page() -> str:
    out = ["# Configuration", "",
           "Every engine setting, generated from its one declaration (`config.setting(...)` in "
           "`orca_jax/config.py`; `orca_jax/engine_args.py` derives the flags and keywords). Each is set in "
           "one of three ways, and a flag given on the command line wins over the file given with `--config`:", "",
           "- an `orca-jax serve` / `orca-jax generate` flag (column *flag*; a true-or-false setting also has "
           "its `--no-` form);",
           "- a key of an engine TOML file, read with `--config FILE` or `load_toml(EngineConfig, FILE)`: a "
           "section's keys go under its `[table]`, and an unknown key is an error naming the allowed ones;",
           "- a keyword of `LLM(...)`: the setting's name unless the table names another; an unknown one is an "
           "error naming its close matches.", "",
           "A wrong value is refused when the config is built, with a message naming the setting and the "
           "fix. `configs/engine/default.toml` writes the defaults out. The server's own flags (address, API "
           "key, queue) are on the [Serving](serving.md#server-flags) page.", ""]
    for table, intro in TABLES.items():
        settings = [s for s in SETTINGS if s.section == table]
        out += [f"## {'Top level' if table is None else f'[{table}]'}", "", intro, "",
                "| setting | flag | default | description |", "|---|---|---|---|",
                *(row(s) for s in settings if s.table_class is None), ""]
    for s in SETTINGS:
        if s.table_class is not None:
            out += [f"## [{s.name}]", "", f"{s.description[0].upper()}{s.description[1:]}.", "",
                    f"Given whole: `{s.flag} JSON` on the command line, `{s.keyword}={{...}}` to `LLM`, or a "
                    f"`[{s.name}]` table in the TOML file. Its keys:", "", *table_keys(s), ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(page())
