"""MkDocs hook: the two generated pages, made at every build from their sources, never written by hand
nor committed: configuration.md from EngineConfig (gen_config_reference.py) and performance.md from
bench/results/latest/ (gen_performance.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gen_config_reference  # noqa: E402
import gen_performance  # noqa: E402


def on_files(files, config):
    for name, make in (("configuration.md", gen_config_reference.page), ("performance.md", gen_performance.page)):
        files.append(File.generated(config, name, content=make()))
    return files
