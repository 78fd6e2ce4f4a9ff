"""The model's matmul precision is explicit: fixed in the traced programs, chosen per dtype by
`auto`, settable by flag and TOML. (On CPU XLA computes float32 dots in full precision whatever they
say; on NVIDIA GPUs "default" means TF32, which is why float32 models ask for "highest".)"""

import argparse
import re

import pytest

from orca_jax.cli import add_engine_args, engine_config
from orca_jax.config import ConfigError, EngineConfig, load_toml, matmul_precision_for
from orca_jax.engine.step_plan import Buckets
from orca_jax.engine_args import config_from_keywords
from orca_jax.runner.model_runner import ModelRunner


class LoweredText:
    """An executable store that keeps the lowered program's text instead of compiling it."""

    directory = None
    loaded = 0

    def load_or_compile(self, name, args, depends_on, lower, out_tree, devices):
        self.depends_on = depends_on
        return lower().as_text()


def layer_dots(model, matmul_precision: str) -> list[str]:
    settings = config_from_keywords(page_size=4, attention_impl="xla", matmul_precision=matmul_precision)
    runner = ModelRunner(model, settings, num_pages=8, max_model_len=32, buckets=Buckets(tokens=(16,), seqs=(4,)),
                         executable_store=LoweredText())
    text = runner.programs.compile(runner.stages[0], "layers", 16)
    assert runner.matmul_precision in runner.executable_store.depends_on  # a stored program keys it
    return re.findall(r"stablehlo\.dot_general.*", text)


def test_auto_is_highest_for_float32_and_default_for_16_bit():
    assert matmul_precision_for("auto", "float32") == "highest"
    assert matmul_precision_for("auto", "bfloat16") == "default"
    assert matmul_precision_for("auto", "float16") == "default"
    assert matmul_precision_for("high", "float32") == "high"


@pytest.mark.parametrize("setting, want", [("auto", "HIGHEST"), ("highest", "HIGHEST"), ("high", "HIGH")])
def test_every_projection_of_a_float32_model_carries_the_precision(tiny_trained, setting, want):
    dots = layer_dots(tiny_trained.model, setting)
    n_layers = tiny_trained.config.n_layers
    assert len(dots) >= 4 * n_layers  # QKV, output and MLP projections of every layer at least
    assert all(f"precision = [{want}, {want}]" in dot for dot in dots), dots[0]


def test_default_leaves_the_choice_to_xla(tiny_trained):
    dots = layer_dots(tiny_trained.model, "default")
    assert dots and not any("HIGH" in dot for dot in dots)


def test_flag_and_toml_set_it_and_a_bad_value_is_named(tmp_path):
    config = tmp_path / "engine.toml"
    config.write_text('matmul_precision = "high"\n')
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--config", str(config)])).matmul_precision == "high"
    assert engine_config(parser.parse_args(["--config", str(config), "--matmul-precision", "highest"])
                         ).matmul_precision == "highest"
    assert EngineConfig().matmul_precision == "auto"
    config.write_text('matmul_precision = "tf32"\n')
    with pytest.raises(ConfigError, match=r"matmul_precision='tf32'; choose one of \['auto', 'highest'"):
        load_toml(EngineConfig, config)
