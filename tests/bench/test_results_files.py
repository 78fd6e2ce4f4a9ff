"""A benchmark run with its default flags writes new files; the committed figures stay untouched."""

import argparse
import importlib

import pytest

from orca_jax.cli import BENCHMARKS
from orca_jax.config import REPO_ROOT


class Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


@pytest.mark.parametrize("name", BENCHMARKS)
def test_default_out_is_a_new_file_beside_the_committed_figures(name, monkeypatch):
    def defaults_only(parser, args=None, namespace=None):
        raise Parsed(parser.parse_known_args([])[0])

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", defaults_only)
    module = importlib.import_module(f"bench_{name}")
    with pytest.raises(Parsed) as parsed:
        module.main()
    out = parsed.value.namespace.out
    assert out.parent == REPO_ROOT / "bench" / "results"
    assert out.name.endswith("_new.json"), out


LATEST = REPO_ROOT / "bench" / "results" / "latest"


def test_every_published_figure_names_its_machine_and_has_a_table():
    """docs/performance.md is made from latest/: each file must say where and when it was measured,
    and belong to a bench the page makes a table for (gen_performance exits naming the file if not)."""
    import json
    import sys

    sys.path.insert(0, str(REPO_ROOT / "docs"))
    import gen_performance

    files = sorted(LATEST.glob("*.json"))
    assert files, "bench/results/latest/ is empty"
    for path in files:
        machine = json.loads(path.read_text())["machine"]
        for key in ("cpu", "native_isa", "date", "commit"):
            assert machine.get(key), f"{path.name}: machine.{key} is missing"
    page = gen_performance.page()
    for path in files:
        assert f"`bench/results/latest/{path.name}`" in page, path.name
