"""The `orca-jax` command as a user runs it (a real subprocess)."""

import subprocess
import sys

from orca_jax.config import REPO_ROOT


def orca_jax(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "orca_jax.cli", *args], capture_output=True, text=True, input=stdin, timeout=300
    )


def test_generate_with_the_tiny_model_from_args_and_stdin():
    tiny = str(REPO_ROOT / "checkpoints" / "tiny")
    result = orca_jax("generate", "--model", tiny, "--max-tokens", "4", "3 5")
    assert result.returncode == 0, result.stderr
    assert ">>> 3 5\n7 9 11 13\n" in result.stdout
    result = orca_jax("generate", "--model", tiny, "--max-tokens", "30", stdin="60 61\n\n50 53\n")
    assert result.returncode == 0, result.stderr
    assert ">>> 60 61\n62 63\n>>> 50 53\n56 59 62\n" in result.stdout  # stops at </s>


def test_missing_model_explains_the_fix(tmp_path):
    for command in (["generate", "--model", str(tmp_path / "nothing"), "hi"],
                    ["serve", "--model", str(tmp_path / "nothing"), "--port", "0"]):
        result = orca_jax(*command)
        assert result.returncode == 2, result.stderr
        assert "no checkpoint" in result.stderr and "orca-jax convert" in result.stderr


def test_serve_takes_the_model_positionally_as_vllm_does(tmp_path):
    nothing = str(tmp_path / "nothing")
    result = orca_jax("serve", nothing, "--port", "0")
    assert result.returncode == 2 and "no checkpoint" in result.stderr and nothing in result.stderr, result.stderr
    result = orca_jax("serve", nothing, "--model", nothing, "--port", "0")  # the same model twice is fine
    assert result.returncode == 2 and "no checkpoint" in result.stderr, result.stderr
    result = orca_jax("serve", nothing, "--model", "smollm2-135m-instruct", "--port", "0")
    assert result.returncode == 2, result.stderr
    assert f"'{nothing}'" in result.stderr and "--model 'smollm2-135m-instruct'" in result.stderr


def test_engine_settings_from_a_config_file_and_flags_over_it(tmp_path):
    config = tmp_path / "engine.toml"
    config.write_text(f'model = "{REPO_ROOT / "checkpoints" / "tiny"}"\n[scheduler]\npolicy = "orca"\n'
                      "max_num_seqs = 4\nmax_num_batched_tokens = 16\n")
    result = orca_jax("generate", "--config", str(config), "--policy", "paged", "--max-tokens", "3", "3 5")
    assert result.returncode == 0, result.stderr
    assert ">>> 3 5\n7 9 11\n" in result.stdout
    assert "policy paged" in result.stderr  # the flag wins over the file
    config.write_text("bogus = 1\n")
    result = orca_jax("generate", "--config", str(config), "3 5")
    assert result.returncode == 2 and "unknown key(s) ['bogus']" in result.stderr


def test_bench_runs_the_named_benchmark_script():
    result = orca_jax("bench", "serving", "--help")
    assert result.returncode == 0, result.stderr
    assert "bench_serving.py" in result.stdout and "--max-concurrency" in result.stdout
    result = orca_jax("bench", "nonsense")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_every_engine_setting_reaches_the_config_flags_over_the_file(tmp_path):
    import argparse

    from orca_jax.cli import add_engine_args, engine_config

    config = tmp_path / "engine.toml"
    config.write_text('max_model_len = 512\n[cache]\nenable_prefix_caching = true\nkv_cache_memory = 4096\n'
                      '[scheduler]\npolicy = "paged"\n[parallel]\ntensor_parallel_size = 3\npipeline_parallel_size = 2\n')
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    from_file = engine_config(parser.parse_args(["--config", str(config)]))
    assert (from_file.max_model_len, from_file.cache.enable_prefix_caching, from_file.scheduler.policy) == (512, True,
                                                                                                         "paged")
    assert (from_file.parallel.tensor_parallel_size, from_file.parallel.pipeline_parallel_size) == (3, 2)
    flags = engine_config(parser.parse_args(["--config", str(config), "--no-enable-prefix-caching", "--max-model-len",
                                             "1024", "--kv-cache-memory", "512MiB", "--pipeline-parallel-size", "1"]))
    assert not flags.cache.enable_prefix_caching and flags.max_model_len == 1024
    assert flags.cache.kv_cache_memory == 512 << 20 and flags.parallel.pipeline_parallel_size == 1
    assert flags.parallel.tensor_parallel_size == 3  # what no flag overrides stays as the file says
