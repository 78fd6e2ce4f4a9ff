import argparse
import dataclasses

import pytest

from orca_jax.config import ConfigError, ParallelConfig, load_model_preset
from orca_jax.parallel.layout import (
    check_parallel,
    check_tensor_parallel,
    kv_heads_for_tp,
    stage_layer_ranges,
    working_tp_sizes,
)
from orca_jax.sizes import byte_size, format_bytes, parse_bytes


def test_stages_are_contiguous_and_earlier_ones_take_the_extra_layers():
    assert stage_layer_ranges(10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert stage_layer_ranges(96, 2) == [range(0, 48), range(48, 96)]
    assert stage_layer_ranges(2, 2) == [range(0, 1), range(1, 2)]
    for n_layers in range(1, 12):
        for pp in range(1, n_layers + 1):
            ranges = stage_layer_ranges(n_layers, pp)
            assert [i for r in ranges for i in r] == list(range(n_layers))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_more_stages_than_layers_is_refused_naming_the_limit():
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=3 exceeds the model's 2 layers.*<= 2"):
        stage_layer_ranges(2, 3)


def test_smollm2_tp2_names_the_sizes_that_work():
    model = load_model_preset("smollm2-135m-instruct")
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(model, 2)
    message = str(err.value)
    assert "smollm2-135m-instruct" in message and "n_heads=9" in message and "n_kv_heads=3" in message
    assert "tp 1 or 3" in message
    check_tensor_parallel(model, 3)


def test_tiny_tp4_fails_on_the_vocabulary_and_names_1_or_2():
    model = load_model_preset("tiny")  # 4 heads / 2 KV heads, d_ff 128, vocab 66
    assert working_tp_sizes(model) == [1, 2]
    with pytest.raises(ConfigError, match=r"vocab_size=66 is not divisible by 4.*tp 1 or 2"):
        check_tensor_parallel(model, 4)


def test_gpt3_presets_split_over_the_papers_tp_sizes():
    for name in ("gpt3-13b", "gpt3-175b"):
        assert 8 in working_tp_sizes(load_model_preset(name))


def test_kv_heads_are_split_or_replicated_up_to_tp():
    tiny = load_model_preset("tiny")
    assert kv_heads_for_tp(tiny, 1) == 2 and kv_heads_for_tp(tiny, 2) == 2
    assert kv_heads_for_tp(load_model_preset("smollm2-135m-instruct"), 3) == 3
    gqa = dataclasses.replace(tiny, vocab_size=64, n_heads=8, n_kv_heads=2, head_dim=8, bos_token_id=None,
                              eos_token_id=None)
    assert [kv_heads_for_tp(gqa, t) for t in (1, 2, 4, 8)] == [2, 2, 4, 8]


def test_too_few_devices_names_needed_visible_and_the_cpu_fix():
    model = load_model_preset("tiny")
    check_parallel(model, ParallelConfig(2, 2), num_devices=4)
    check_parallel(model, ParallelConfig(2, 2), num_devices=None)
    with pytest.raises(ConfigError, match=r"needs 4 devices, but 3 are visible.*JAX_NUM_CPU_DEVICES=4"):
        check_parallel(model, ParallelConfig(2, 2), num_devices=3)
    with pytest.raises(ConfigError, match="exceeds the model's 2 layers"):
        check_parallel(model, ParallelConfig(1, 3))


@pytest.mark.parametrize("text, expected", [
    ("40GiB", 40 << 30), ("4 GB", 4 * 10**9), ("1.5KiB", 1536), ("123", 123), (123, 123), ("10B", 10),
    ("2TiB", 2 << 40), ("1kb", 1000), ("512MiB", 512 << 20), ("3MB", 3 * 10**6), ("1TB", 10**12),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["40G", "abc", "-1", "1.2.3", "", "GiB", -5])
def test_parse_bytes_names_the_accepted_forms(text):
    with pytest.raises(ValueError, match="GiB.*KB"):
        parse_bytes(text)


def test_byte_size_flag_reports_the_accepted_forms():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device-memory", type=byte_size)
    assert parser.parse_args(["--device-memory", "40GiB"]).device_memory == 40 << 30
    with pytest.raises(argparse.ArgumentTypeError, match="GiB"):
        byte_size("40G")


def test_format_bytes():
    assert format_bytes(40 << 30) == "40.00 GiB"
    assert format_bytes(12.5 * 2**20) == "12.50 MiB"
    assert format_bytes(512) == "512 B"
