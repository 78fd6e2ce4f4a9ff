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
