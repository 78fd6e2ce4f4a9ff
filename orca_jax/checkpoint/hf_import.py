"""Import a Hugging Face model folder (config.json + *.safetensors [+ tokenizer.json]).

The Llama-shape families of checkpoint/hf_families.py (llama, qwen2, qwen3, phi3, mistral, gemma2,
gemma3_text) and GPT-2. A config field this decoder does not implement is refused by name. The
weights keep the checkpoint's own dtype (config.json's `torch_dtype`, else the tensors'): a bfloat16
model is stored as bfloat16; which dtype it runs in is decided when it is loaded (`--dtype`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from orca_jax.checkpoint.hf_families import (LLAMA_SHAPE_FAMILIES, NAMES, HFImportError, id_list,
                                             llama_shape_config, prepare_tensors, single_id)
from orca_jax.checkpoint.layout import ImportedModel, Part, names_by_part
from orca_jax.config import ModelConfig
from orca_jax.tokenizer import Tokenizer


SUPPORTED_MODEL_TYPES = (*LLAMA_SHAPE_FAMILIES, "gpt2")
# GPT-2 checkpoints come with or without the "transformer." prefix. Its Conv1D weights are stored
# [in, out]; `GPT2_TRANSPOSED` lists those to flip into the common [out, in] layout.
GPT2_NAMES = {
    r"(?:transformer\.)?wte\.weight": "token_embd.weight",
    r"(?:transformer\.)?wpe\.weight": "position_embd.weight",
    r"(?:transformer\.)?h\.(\d+)\.ln_1\.(weight|bias)": "blk.{i}.attn_norm.{p}",
    r"(?:transformer\.)?h\.(\d+)\.attn\.c_attn\.(weight|bias)": "blk.{i}.attn_qkv.{p}",
    r"(?:transformer\.)?h\.(\d+)\.attn\.c_proj\.(weight|bias)": "blk.{i}.attn_output.{p}",
    r"(?:transformer\.)?h\.(\d+)\.ln_2\.(weight|bias)": "blk.{i}.ffn_norm.{p}",
    r"(?:transformer\.)?h\.(\d+)\.mlp\.c_fc\.(weight|bias)": "blk.{i}.ffn_up.{p}",
    r"(?:transformer\.)?h\.(\d+)\.mlp\.c_proj\.(weight|bias)": "blk.{i}.ffn_down.{p}",
    r"(?:transformer\.)?ln_f\.(weight|bias)": "output_norm.{p}",
    r"lm_head\.weight": "output.weight",
}
GPT2_TRANSPOSED = re.compile(r"blk\.\d+\.(attn_qkv|attn_output|ffn_up|ffn_down)\.weight")
# Buffers some exporters save that are not parameters.
IGNORED = re.compile(r".*(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")


def open_hf_folder(folder: str | Path, name: str) -> ImportedModel:
    """The model in an HF folder, its tensors read a layer at a time (`ImportedModel.read_part`)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise HFImportError(f"{folder} has no config.json; expected a Hugging Face model folder")
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise HFImportError(f"{config_file} is not valid JSON: {e}") from None
    model_type = hf_config.get("model_type")
    try:
        if model_type == "gpt2":
            config, names = _gpt2_config(hf_config, name), GPT2_NAMES
        elif model_type in LLAMA_SHAPE_FAMILIES:
            config, names = llama_shape_config(hf_config, model_type, name, config_file), NAMES[model_type]
        else:
            raise HFImportError(f"{config_file}: model_type {model_type!r} is not supported; supported: "
                                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    except KeyError as e:
        raise HFImportError(f"{config_file} lacks the key {e.args[0]!r} a {model_type} config needs") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFImportError(f"{folder} has no *.safetensors files (PyTorch .bin files are not supported)")
    where: dict[str, tuple[Path, str]] = {}  # GGUF name -> (file, HF name), from the headers alone
    matrix_dtypes = set()
    for file in files:
        with _open(file) as f:
            for hf_name in f.keys():
                if IGNORED.match(hf_name):
                    continue
                where[_rename(hf_name, names, file)] = (file, hf_name)
                header = f.get_slice(hf_name)
                if len(header.get_shape()) == 2:
                    matrix_dtypes.add(SAFETENSORS_DTYPES.get(header.get_dtype(), header.get_dtype()))
    config = dataclasses.replace(config, dtype=_checkpoint_dtype(hf_config, matrix_dtypes, config_file),
                                 extra_eos_token_ids=_end_of_sequence_ids(hf_config, folder))
    by_part = names_by_part(config, where)

    def read_part(part: Part) -> dict[str, np.ndarray]:
        tensors = {}
        by_file = itertools.groupby(sorted(by_part[part], key=lambda n: where[n][0]), key=lambda n: where[n][0])
        for file, gguf_names in by_file:
            # Opened for each part: closing it unmaps the file, so the pages read leave this
            # process's memory with the part instead of adding up to the whole model.
            with _open(file) as f:
                for gguf_name in gguf_names:
                    array = f.get_tensor(where[gguf_name][1])
                    transposed = model_type == "gpt2" and GPT2_TRANSPOSED.fullmatch(gguf_name)
                    tensors[gguf_name] = array.T if transposed else array
        prepare_tensors(tensors, config, model_type)
        return tensors

    return ImportedModel(config, _tokenizer(folder, config), read_part)


def _open(file: Path):
    try:
        return safe_open(file, framework="numpy")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError, not an OSError
        raise HFImportError(f"cannot read {file} as safetensors: {e}") from None


SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# safetensors' dtype codes (in a file's header) by numpy's names; an unlisted code is reported as is.
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _checkpoint_dtype(hf_config: dict, matrix_dtypes: set[str], config_file: Path) -> str:
    """The dtype the checkpoint was saved in: `torch_dtype` (`dtype` in newer transformers), else the
    dtype of its weight matrices, else float32."""
    declared = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if declared is None:
        declared = next(iter(matrix_dtypes)) if len(matrix_dtypes) == 1 else "float32"
    if declared not in SUPPORTED_DTYPES:
        raise HFImportError(f"{config_file}: weights in {declared} are not supported; supported: "
                            f"{list(SUPPORTED_DTYPES)}")
    return declared


def _end_of_sequence_ids(hf_config: dict, folder: Path) -> tuple[int, ...]:
    """Every end-of-sequence id the folder lists: config.json's `eos_token_id` and
    generation_config.json's (each an id or a list), where transformers' generate() reads them.
    Instruct models end a turn with one of them: Llama 3.x lists <|eot_id|> in both files, Phi-3 its
    <|end|> in generation_config.json only."""
    ids = id_list(hf_config.get("eos_token_id"))
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        try:
            ids += id_list(json.loads(generation_file.read_text()).get("eos_token_id"))
        except json.JSONDecodeError as e:
            raise HFImportError(f"{generation_file} is not valid JSON: {e}") from None
    return tuple(ids)


def _rename(hf_name: str, names: dict[str, str], file: Path) -> str:
    for pattern, target in names.items():
        match = re.fullmatch(pattern, hf_name)
        if match:
            groups = match.groups()
            return target.format(i=groups[0] if groups and "{i}" in target else None, p=groups[-1] if groups else None)
    raise HFImportError(f"{file}: tensor {hf_name!r} is not part of the supported layout")


def _gpt2_config(c: dict, name: str) -> ModelConfig:
    if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HFImportError(f"activation_function={c['activation_function']!r} is not supported; GPT-2 uses gelu_new")
    return ModelConfig(
        name=name,
        architecture="gpt2",
        vocab_size=c["vocab_size"],
        d_model=c["n_embd"],
        n_layers=c["n_layer"],
        n_heads=c["n_head"],
        n_kv_heads=c["n_head"],
        d_ff=c.get("n_inner") or 4 * c["n_embd"],
        max_position=c["n_positions"],
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=single_id(c.get("bos_token_id")),
        eos_token_id=single_id(c.get("eos_token_id")),
    )


def _tokenizer(folder: Path, config: ModelConfig) -> Tokenizer | None:
    if not (folder / "tokenizer.json").is_file():
        return None
    settings_file = folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    template = settings.get("chat_template")
    template_file = folder / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text()
    return Tokenizer(
        HFTokenizer.from_file(str(folder / "tokenizer.json")),
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        extra_eos_token_ids=config.extra_eos_token_ids,
        add_bos_token=bool(settings.get("add_bos_token", False)),
        chat_template=template if isinstance(template, str) else None,
    )
