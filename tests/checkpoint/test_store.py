import jax
import numpy as np
import pytest
from flax import nnx

from orca_jax.checkpoint.store import CheckpointError, CheckpointWriter, flatten_params, load_model, save_checkpoint
from orca_jax.config import load_model_preset
from orca_jax.model.decoder import init_decoder


def params_of(model):
    return flatten_params(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))))


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_save_restore_round_trip(tmp_path, preset):
    config = load_model_preset(preset)
    original = params_of(init_decoder(config, seed=3))
    save_checkpoint(tmp_path / "ckpt", config, original)
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.config == config
    assert loaded.tokenizer is None
    restored = params_of(loaded.model)
    assert restored.keys() == original.keys()
    for name in original:
        np.testing.assert_array_equal(restored[name], original[name], err_msg=name)


def test_missing_checkpoint_names_the_pull_command(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCA_JAX_CHECKPOINTS", str(tmp_path))
    with pytest.raises(CheckpointError, match="orca-jax pull smollm2-135m-instruct"):
        load_model("smollm2-135m-instruct")
    with pytest.raises(CheckpointError, match="orca-jax convert"):
        load_model("gpt3-13b")


def test_weights_that_do_not_match_the_config_are_rejected(tmp_path):
    config = load_model_preset("tiny")
    save_checkpoint(tmp_path / "ckpt", config, params_of(init_decoder(config)))
    toml = tmp_path / "ckpt" / "model.toml"
    toml.write_text(toml.read_text().replace("d_ff = 128", "d_ff = 96"))
    with pytest.raises(CheckpointError, match="do not match.*mlp"):
        load_model(tmp_path / "ckpt")


def test_save_rejects_params_of_another_shape(tmp_path):
    params = params_of(init_decoder(load_model_preset("tiny")))
    del params["final_norm.scale"]
    with pytest.raises(CheckpointError, match="missing.*final_norm.scale"):
        save_checkpoint(tmp_path / "ckpt", load_model_preset("tiny"), params)


def test_the_writer_checks_each_write_and_a_new_save_starts_afresh(tmp_path):
    """A converter writes a part at a time: every part is checked as it comes, `finish` names what
    never came, and a save into the directory of an interrupted one does not carry its parts on."""
    config = load_model_preset("tiny")
    params = params_of(init_decoder(config, seed=4))
    writer = CheckpointWriter(tmp_path / "ckpt", config)
    writer.write({"embed.embedding": params["embed.embedding"]})
    with pytest.raises(CheckpointError, match="written twice.*embed.embedding"):
        writer.write({"embed.embedding": params["embed.embedding"]})
    with pytest.raises(CheckpointError, match="unexpected.*layers.9.attn.q.kernel"):
        writer.write({"layers.9.attn.q.kernel": params["layers.0.attn.q.kernel"]})
    with pytest.raises(CheckpointError, match="wrong shapes.*final_norm.scale"):
        writer.write({"final_norm.scale": np.ones(3, np.float32)})
    with pytest.raises(CheckpointError, match="missing.*layers.0.attn.k.kernel"):
        writer.finish()
    save_checkpoint(tmp_path / "ckpt", config, params)  # over the interrupted one's saves
    restored = params_of(load_model(tmp_path / "ckpt").model)
    for name in params:
        np.testing.assert_array_equal(restored[name], params[name], err_msg=name)
