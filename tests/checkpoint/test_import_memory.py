"""`convert` goes a layer at a time: the process converting a model whose weights dwarf everything
else (389 MiB of float32 in 24 layers of 16.8 MB) grows its peak resident memory by far less than the
model, from an HF folder (one safetensors file per layer, as large models ship) and from a GGUF file.

The peak is measured in a fresh process: after the imports, the kernel's peak RSS counter (VmHWM)
is reset to the current RSS (/proc/self/clear_refs), then read once the conversion is done, so it
counts every byte the conversion held at once, file pages mapped in as well.
"""

import json
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import save_file

from orca_jax.checkpoint.store import open_model
from orca_jax.config import REPO_ROOT

LAYERS, D, D_FF, VOCAB, HEADS = 24, 512, 2048, 2048, 8
LAYER_BYTES = 4 * (4 * D * D + 3 * D * D_FF + 2 * D)
MODEL_BYTES = LAYERS * LAYER_BYTES + 4 * (VOCAB * D + D)

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")


def layer_tensors(i: int) -> dict[str, np.ndarray]:
    """Layer i in the common GGUF-named [out, in] layout, random so that nothing compresses."""
    rng = np.random.default_rng(i)

    def matrix(rows, cols):
        return rng.random((rows, cols), dtype=np.float32)

    return {f"blk.{i}.attn_norm.weight": np.ones(D, np.float32), f"blk.{i}.ffn_norm.weight": np.ones(D, np.float32),
            **{f"blk.{i}.attn_{p}.weight": matrix(D, D) for p in ("q", "k", "v", "output")},
            f"blk.{i}.ffn_gate.weight": matrix(D_FF, D), f"blk.{i}.ffn_up.weight": matrix(D_FF, D),
            f"blk.{i}.ffn_down.weight": matrix(D, D_FF)}


def global_tensors() -> dict[str, np.ndarray]:
    return {"token_embd.weight": np.random.default_rng(99).random((VOCAB, D), dtype=np.float32),
            "output_norm.weight": np.ones(D, np.float32)}


HF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("big-hf")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": D, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "intermediate_size": D_FF,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}))
    glob = global_tensors()
    save_file({"model.embed_tokens.weight": glob["token_embd.weight"], "model.norm.weight": glob["output_norm.weight"]},
              folder / f"model-00000-of-{LAYERS:05d}.safetensors")
    for i in range(LAYERS):
        save_file({f"model.layers.{i}.{HF_NAMES[name.split('.')[2]]}.weight": array
                   for name, array in layer_tensors(i).items()}, folder / f"model-{i + 1:05d}-of-{LAYERS:05d}.safetensors")
    yield folder
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("big-gguf") / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(D_FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    # The tensors are listed first, then written one by one as they are made: `add_tensor` would
    # hold the whole model in this process.
    for name, array in global_tensors().items():
        writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes)
    for i in range(LAYERS):
        for name, array in layer_tensors(0).items():
            writer.add_tensor_info(name.replace("blk.0.", f"blk.{i}."), array.shape, array.dtype, array.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for array in global_tensors().values():
        writer.write_tensor_data(array)
    for i in range(LAYERS):
        for array in layer_tensors(i).values():
            writer.write_tensor_data(array)
    writer.close()
    yield path
    shutil.rmtree(path.parent)


MEASURE = """
import sys
from orca_jax.checkpoint.convert import convert

def kib(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

open("/proc/self/clear_refs", "w").write("5")  # the peak RSS (VmHWM) starts again from the current RSS
before = kib("VmRSS")
convert(sys.argv[1], "big", sys.argv[2])
print(kib("VmHWM") - before)
"""


def converting_peak_growth(source, out) -> int:
    """Bytes by which the peak RSS of a process converting `source` rose above its RSS before."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", MEASURE, str(source), str(out)], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split()[-1]) * 1024


def restored(checkpoint, name: str) -> np.ndarray:
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(checkpoint / "params", args=ocp.args.PyTreeRestore(
            item={name: np.zeros(0)}, restore_args={name: ocp.RestoreArgs(restore_type=np.ndarray)},
            partial_restore=True))[name]


@pytest.mark.parametrize("source", ["hf_folder", "gguf_file"])
def test_converting_holds_about_a_layer_not_the_model(source, request, tmp_path):
    growth = converting_peak_growth(request.getfixturevalue(source), tmp_path / "out")
    # Measured (2-core Xeon): about 0.1 GiB, a few layers' worth plus orbax's own buffers; holding
    # the model whole at any moment costs at least its 389 MiB.
    assert growth < MODEL_BYTES / 2, (f"converting grew the peak RSS by {growth / 2**20:.0f} MiB for a "
                                      f"{MODEL_BYTES / 2**20:.0f} MiB model ({LAYER_BYTES / 2**20:.1f} MiB a layer)")
    opened = open_model(tmp_path / "out")  # the whole model's shapes are there
    assert opened.config.n_layers == LAYERS and opened.config.dtype == "float32"
    for i in (0, LAYERS - 1):  # (ffn_down: the GGUF's Q and K rows are not permuted as llama.cpp's are)
        np.testing.assert_array_equal(restored(tmp_path / "out", f"layers.{i}.mlp.down.kernel"),
                                      layer_tensors(i)[f"blk.{i}.ffn_down.weight"].T)
    shutil.rmtree(tmp_path / "out")
