"""Every end-of-sequence id a checkpoint lists stops generation, wherever it is listed: HF's
config.json (a list), generation_config.json alone, a GGUF's eot and eom ids, and a GGUF token that
llama.cpp takes for an end by its text.

Each source is written holding the trained tiny model's weights (it counts: "3 5" continues 7 9 11
13 ...) and makes one of those numbers an end of sequence; the import is converted to a checkpoint
and loaded, and its config and tokenizer drive an engine on the session's tiny runner (same weights,
compiled once)."""

import json
import shutil

import gguf
import numpy as np
import pytest

from orca_jax.checkpoint.convert import convert
from orca_jax.checkpoint.gguf_import import end_of_generation_ids
from orca_jax.checkpoint.gguf_reader import GGUFReader
from orca_jax.checkpoint.store import load_model
from orca_jax.checkpoint.train_tiny import BOS, EOS
from orca_jax.sampling_params import SamplingParams

from tests.checkpoint.test_import import llama_gguf_writer, llama_tensors, write_hf_llama_folder
from tests.checkpoint.test_store import params_of

from .conftest import TINY_LIMITS, make_engine, run_all

PROMPT = [BOS, 3, 5]  # greedy: 7 9 11 13 15 ...


def generate(tiny_runner, loaded, params=None):
    """The one completion of PROMPT (greedy, up to 6 tokens) under `loaded`'s config and tokenizer."""
    engine = make_engine(tiny_runner, loaded, "chunked", **TINY_LIMITS)
    return run_all(engine, [(PROMPT, params or SamplingParams(temperature=0, max_tokens=6))])[0].outputs[0]


def hf_checkpoint(tmp_path, tiny_trained, eos_token_id, generation_eos_token_id=None):
    folder = tmp_path / "hf"
    write_hf_llama_folder(folder, tiny_trained.config, tiny_trained.model, eos_token_id=eos_token_id)
    shutil.copy(tiny_trained.path / "tokenizer.json", folder)
    if generation_eos_token_id is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos_token_id}))
    return load_model(convert(folder, "hf", tmp_path / "checkpoint"))


def write_tiny_gguf(path, tiny_trained, tokens=None, **token_ids):
    """The tiny model as a llama GGUF; `tokens` its vocabulary (default: the numbers, <s>, </s>),
    `token_ids` more tokenizer.ggml.*_token_id keys (eot=9: tokenizer.ggml.eot_token_id = 9)."""
    config = tiny_trained.config
    tokens = tokens or [str(i) for i in range(BOS)] + ["<s>", "</s>"]
    writer = llama_gguf_writer(path, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    for key, value in token_ids.items():
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    for name, array in llama_tensors(config, params_of(tiny_trained.model), permute_qk=True).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_checkpoint(tmp_path, tiny_trained, tokens=None, **token_ids):
    path = write_tiny_gguf(tmp_path / "model.gguf", tiny_trained, tokens, **token_ids)
    return load_model(convert(path, "gguf", tmp_path / "checkpoint"))


def test_a_checkpoint_with_one_eos_id_still_loads_and_stops_there(tiny_trained):
    """checkpoints/tiny was written before the lists: model.toml and tokenizer_config.json name one id."""
    assert tiny_trained.config.eos_token_ids == {EOS} and tiny_trained.tokenizer.eos_token_ids == {EOS}


def test_hf_config_list_stops_at_any_of_its_ids(tmp_path, tiny_trained, tiny_runner):
    loaded = hf_checkpoint(tmp_path, tiny_trained, eos_token_id=[EOS, 11])
    # Kept as a set in the config and the tokenizer, through the checkpoint's files.
    assert loaded.config.eos_token_id == EOS and loaded.config.eos_token_ids == {EOS, 11}
    assert loaded.tokenizer.eos_token_id == EOS and loaded.tokenizer.eos_token_ids == {EOS, 11}
    out = generate(tiny_runner, loaded)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([7, 9, 11], "stop", None)
    assert out.text == " 7 9"  # the end's text is left out (11 is no special token, it would show)


def test_ignore_eos_and_min_tokens_cover_every_end_of_sequence_id(tmp_path, tiny_trained, tiny_runner):
    loaded = hf_checkpoint(tmp_path, tiny_trained, eos_token_id=[EOS, 9])
    ignored = generate(tiny_runner, loaded, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert (ignored.token_ids, ignored.finish_reason) == ([7, 9, 11, 13], "length")
    # Suppressed on the device until min_tokens: the second token cannot be 9.
    held = generate(tiny_runner, loaded, SamplingParams(temperature=0, max_tokens=6, min_tokens=3))
    assert held.token_ids[0] == 7 and 9 not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_generation_config_alone_lists_an_end_of_sequence_id(tmp_path, tiny_trained, tiny_runner):
    """Phi-3's <|end|> is in generation_config.json only."""
    loaded = hf_checkpoint(tmp_path, tiny_trained, eos_token_id=EOS, generation_eos_token_id=[EOS, 9])
    assert loaded.config.eos_token_id == EOS and loaded.config.eos_token_ids == {EOS, 9}
    out = generate(tiny_runner, loaded)
    assert (out.token_ids, out.finish_reason, out.text) == ([7, 9], "stop", " 7")


@pytest.mark.parametrize("key, end", [("eot", 9), ("eom", 11)])
def test_gguf_eot_and_eom_ids_end_a_sequence(tmp_path, tiny_trained, tiny_runner, key, end):
    loaded = gguf_checkpoint(tmp_path, tiny_trained, **{key: end})
    assert loaded.config.eos_token_ids == {EOS, end} and loaded.tokenizer.eos_token_ids == {EOS, end}
    out = generate(tiny_runner, loaded)
    assert out.token_ids == list(range(7, end + 1, 2)) and out.finish_reason == "stop"


@pytest.mark.parametrize("text", ["<|eot_id|>", "<end_of_turn>"])
def test_a_gguf_token_spelled_as_an_end_ends_a_sequence(tmp_path, tiny_trained, tiny_runner, text):
    """No eot id in the file: llama.cpp takes Llama 3's <|eot_id|> or Gemma's <end_of_turn> by its text."""
    tokens = [str(i) for i in range(BOS)] + ["<s>", "</s>"]
    tokens[11] = text
    loaded = gguf_checkpoint(tmp_path, tiny_trained, tokens)
    assert loaded.config.eos_token_ids == {EOS, 11}
    out = generate(tiny_runner, loaded)
    assert (out.token_ids, out.finish_reason, out.text) == ([7, 9, 11], "stop", "79")


def test_gguf_end_of_generation_follows_llama_cpp_exceptions(tmp_path):
    """Where <|return|> and <|call|> end an answer, <|end|> only ends a message (gpt-oss); the file's
    fill-in-the-middle separator ends generation too."""
    tokens = ["<|endoftext|>", "<|end|>", "<|return|>", "<|call|>", "<|file_sep|>", "a"]
    writer = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    writer.add_token_list(tokens)
    writer.add_eos_token_id(5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert end_of_generation_ids(GGUFReader(str(tmp_path / "vocab.gguf"))) == (0, 2, 3, 4, 5)
