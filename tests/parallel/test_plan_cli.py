import argparse

import pytest

from orca_jax.config import ParallelConfig, load_model_preset, model_config_to_toml
from orca_jax.parallel.memory_plan import plan_memory
from orca_jax.parallel.plan_cli import add_plan_arguments, plan_command


def plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orca-jax plan")
    add_plan_arguments(parser)
    return plan_command(parser.parse_args(argv))


def test_prints_the_plan_of_a_preset(capsys):
    assert plan(["--model", "gpt3-13b", "--device-memory", "40GiB"]) == 0
    expected = plan_memory(load_model_preset("gpt3-13b"), ParallelConfig(), page_size=16, device_memory=40 << 30)
    assert capsys.readouterr().out == expected.summary() + "\n"


def test_paper_layout_of_175b(capsys):
    argv = ["--model", "gpt3-175b", "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
            "--device-memory", "40GiB", "--max-model-len", "1024", "--page-size", "32"]
    assert plan(argv) == 0
    out = capsys.readouterr().out
    assert "tp 8 x pp 2 = 16 devices" in out and "layers per stage: 0-47, 48-95" in out
    assert "x 32 tokens" in out and "sequences of 1024 tokens" in out


def test_refusal_prints_error_and_returns_2(capsys):
    assert plan(["--model", "gpt3-175b", "--device-memory", "40GiB"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: gpt3-175b") and "GiB per device" in captured.err


def test_smollm2_tp2_refusal_names_1_or_3(capsys):
    assert plan(["--model", "smollm2-135m-instruct", "--tensor-parallel-size", "2", "--kv-cache-memory", "1GiB"]) == 2
    assert "tp 1 or 3" in capsys.readouterr().err


def test_checkpoint_directory_with_model_toml(tmp_path, capsys):
    (tmp_path / "model.toml").write_text(model_config_to_toml(load_model_preset("tiny")))
    assert plan(["--model", str(tmp_path), "--kv-cache-memory", "1MiB", "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.startswith("tiny (bfloat16) on tp 1 x pp 1 = 1 device\n")


def test_unknown_model_lists_the_presets(capsys):
    assert plan(["--model", "no-such-model", "--kv-cache-memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "gpt3-175b" in err


def test_unreadable_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan(["--model", "tiny", "--device-memory", "40G"])
    assert exit_info.value.code == 2
    assert "GiB" in capsys.readouterr().err


def test_without_a_memory_figure_the_plan_is_the_cpu_engines(monkeypatch, capsys):
    """No --device-memory or --kv-cache-memory: this host's free memory, as the engine on CPU sizes
    its cache (capped at --max-num-seqs sequences), so `orca-jax plan` says what the engine will do."""
    from orca_jax import host_memory

    monkeypatch.setattr(host_memory, "available_host_memory", lambda: 1 << 30)
    assert plan(["--model", "tiny", "--max-num-seqs", "3"]) == 0
    expected = plan_memory(load_model_preset("tiny"), ParallelConfig(), page_size=16, host_memory=1 << 30,
                           max_num_seqs=3)
    out = capsys.readouterr().out
    assert out == expected.summary() + "\n" and "3 sequences of 128 tokens, capped at max_num_seqs=3" in out
    # Where the host's figure is unknown, the engine's fixed default, capped the same way.
    monkeypatch.setattr(host_memory, "available_host_memory", lambda: None)
    assert plan(["--model", "tiny", "--max-num-seqs", "3"]) == 0
    expected = plan_memory(load_model_preset("tiny"), ParallelConfig(), page_size=16, kv_cache_memory=1 << 30,
                           max_num_seqs=3)
    assert capsys.readouterr().out == expected.summary() + "\n" and expected.num_pages == 3 * 8
