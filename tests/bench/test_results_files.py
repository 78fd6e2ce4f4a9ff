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


def test_a_run_of_another_gguf_file_gets_its_own_rows_and_stays_out_of_readme(tmp_path, monkeypatch):
    """compare_llama_cpp.sh on a Q8_0 file with SERVING=0 (one request only), saved as
    latest/vs_llama_cpp_<cpu>_<what>.json: its table and heading name Q8_0 and carry no serving rows,
    and README's headline stays the default file's run even though this one is newer."""
    import json
    import sys

    sys.path.insert(0, str(REPO_ROOT / "docs"))
    import gen_performance

    default = json.loads((LATEST / "vs_llama_cpp_zen4.json").read_text())
    other = {key: value for key, value in default.items() if key != "serving"}
    other["llama_server_single_stream_tok_s"] = {"q8_0": [50.0], "f32": [20.0]}
    other["machine"] = {**default["machine"], "date": "2099-01-01", "commit": "later"}
    (tmp_path / "latest").mkdir()
    (tmp_path / "latest" / "vs_llama_cpp_zen4.json").write_text(json.dumps(default))
    (tmp_path / "latest" / "vs_llama_cpp_zen4_q8_0.json").write_text(json.dumps(other))
    monkeypatch.setattr(gen_performance, "ROOT", tmp_path)
    monkeypatch.setattr(gen_performance, "LATEST", tmp_path / "latest")

    rows = gen_performance.vs_llama_cpp(other)
    assert any("Q8_0 (`--quantization gguf`)" in row and "50.0" in row for row in rows)
    assert not any("in flight" in row or "Q4_1" in row for row in rows)
    assert gen_performance.heading("vs_llama_cpp", other).endswith(", Q8_0")
    headline = gen_performance.headline()
    assert "Q4_1" in headline and "Q8_0" not in headline and "later" not in headline
    # A newer run of the default file with the AVX2 kernels forced stays on the page too.
    forced = {**default, "forced_native_isa": "avx2", "machine": {**default["machine"], "date": "2099-01-02",
                                                                  "native_isa": "avx2", "commit": "forced"}}
    (tmp_path / "latest" / "vs_llama_cpp_zen4_avx2.json").write_text(json.dumps(forced))
    assert gen_performance.heading("vs_llama_cpp", forced).endswith(", Q4_1, native kernels forced to `avx2`")
    assert "forced" not in gen_performance.headline()
    # compare_llama_cpp.sh's AVX2-only stand-in (llama.cpp built without AVX-512 too) says so.
    emulated = {**forced, "llama_cpp_isa": "avx2", "xla_flags": " --xla_cpu_max_isa=AVX2"}
    assert gen_performance.heading("vs_llama_cpp", emulated).endswith(", Q4_1, an AVX2-only CPU emulated (our kernels, "
                                                                      "XLA's code and llama.cpp's build all stop at AVX2)")


def test_one_request_ratio_carries_the_median_of_its_alternated_pairs():
    """Best against best can pair a quiet moment of ours with a slow one of llama-server's: the row
    also gives the median of each run's ratio to llama-server's run right after it, and none for
    runs from before the two sides alternated (no llama-server figure in the run)."""
    import sys

    sys.path.insert(0, str(REPO_ROOT / "docs"))
    import gen_performance

    runs = [{"decode_tok_s": 120.0, "llama_server_tok_s": 100.0},   # 1.20
            {"decode_tok_s": 150.0, "llama_server_tok_s": 150.0},   # 1.00: the best of ours beside theirs
            {"decode_tok_s": 110.0, "llama_server_tok_s": 100.0}]   # 1.10
    d = {"single_stream": {"quantization": {"gguf": {"best_tok_s": 150.0, "runs": runs}}},
         "llama_server_single_stream_tok_s": {"q4_1": [100.0, 150.0, 100.0]}, "concurrency": 16}
    row = gen_performance.vs_llama_cpp(d)[2]
    assert "**1.00x** (median of 3 alternated pairs: 1.10x)" in row, row
    for run in runs:
        del run["llama_server_tok_s"]
    assert gen_performance.vs_llama_cpp(d)[2].rstrip(" |").endswith("**1.00x**")
