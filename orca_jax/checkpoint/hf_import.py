"""Import a Hugging Face model folder (config.json + *.safetensors [+ tokenizer.json]).

Llama-shape families (`model_type` llama, qwen2 -- Qwen2 and Qwen2.5 --, qwen3) and GPT-2. A
config field this decoder does not implement (sliding windows, MLP biases, ...) is refused by name. The
weights keep the checkpoint's own dtype (config.json's `torch_dtype`, else the tensors'): a bfloat16
model is stored as bfloat16; which dtype it runs in is decided when it is loaded (`--dtype`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from orca_jax.checkpoint.layout import to_decoder_params
from orca_jax.config import ModelConfig
from orca_jax.tokenizer import Tokenizer


class HFImportError(ValueError):
    pass


# HF tensor name pattern -> GGUF name, per architecture. "{i}" is the layer index.
LLAMA_NAMES = {
    r"model\.embed_tokens\.weight": "token_embd.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": "blk.{i}.attn_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": "blk.{i}.attn_q.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": "blk.{i}.attn_k.weight",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": "blk.{i}.attn_v.weight",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": "blk.{i}.attn_output.weight",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": "blk.{i}.ffn_norm.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": "blk.{i}.ffn_gate.weight",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": "blk.{i}.ffn_up.weight",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": "blk.{i}.ffn_down.weight",
    r"model\.norm\.weight": "output_norm.weight",
    r"lm_head\.weight": "output.weight",
}
# Qwen2/2.5 add q/k/v biases to the Llama layout; Qwen3 drops them and norms each head's q and k.
QWEN2_NAMES = LLAMA_NAMES | {
    r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.bias": "blk.{i}.attn_{p}.bias",
}
QWEN3_NAMES = LLAMA_NAMES | {
    r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight": "blk.{i}.attn_{p}_norm.weight",
}
# Phi-3 fuses q, k, v into one matrix and the MLP's gate and up into another; split at import.
PHI3_NAMES = {pattern: target for pattern, target in LLAMA_NAMES.items()
              if not re.search(r"[qkv]_proj|gate_proj|up_proj", pattern)} | {
    r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight": "blk.{i}.attn_qkv.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight": "blk.{i}.ffn_gate_up.weight",
}
# model_type -> (tensor names, ModelConfig switches) of the Llama-shape families.
LLAMA_SHAPE_FAMILIES = {
    "llama": (LLAMA_NAMES, {}),
    "qwen2": (QWEN2_NAMES, {"qkv_bias": True}),
    "qwen3": (QWEN3_NAMES, {"qk_norm": True}),
    "phi3": (PHI3_NAMES, {}),
}
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


def read_hf_folder(folder: str | Path, name: str) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None]:
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
            names, switches = LLAMA_SHAPE_FAMILIES[model_type]
            _refuse_unsupported_fields(hf_config, model_type, config_file)
            config = _llama_config(hf_config, name, **switches)
        else:
            raise HFImportError(f"{config_file}: model_type {model_type!r} is not supported; supported: "
                                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    except KeyError as e:
        raise HFImportError(f"{config_file} lacks the key {e.args[0]!r} a {model_type} config needs") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFImportError(f"{folder} has no *.safetensors files (PyTorch .bin files are not supported)")
    tensors = {}
    for file in files:
        try:
            reader = safe_open(file, framework="numpy")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError, not an OSError
            raise HFImportError(f"cannot read {file} as safetensors: {e}") from None
        with reader as f:
            for hf_name in f.keys():
                if IGNORED.match(hf_name):
                    continue
                gguf_name = _rename(hf_name, names, file)
                array = f.get_tensor(hf_name)
                tensors[gguf_name] = array.T if GPT2_TRANSPOSED.fullmatch(gguf_name) and model_type == "gpt2" else array
    if model_type == "phi3":
        _split_fused_phi3(tensors, config)
    config = dataclasses.replace(config, dtype=_checkpoint_dtype(hf_config, tensors, config_file))
    return config, to_decoder_params(config, tensors), _tokenizer(folder, config)


SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def _checkpoint_dtype(hf_config: dict, tensors: dict[str, np.ndarray], config_file: Path) -> str:
    """The dtype the checkpoint was saved in: `torch_dtype` (`dtype` in newer transformers), else the
    dtype of its weight matrices, else float32."""
    declared = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if declared is None:
        matrix_dtypes = {str(a.dtype) for a in tensors.values() if a.ndim == 2}
        declared = matrix_dtypes.pop() if len(matrix_dtypes) == 1 else "float32"
    if declared not in SUPPORTED_DTYPES:
        raise HFImportError(f"{config_file}: weights in {declared} are not supported; supported: "
                            f"{list(SUPPORTED_DTYPES)}")
    return declared


def _rename(hf_name: str, names: dict[str, str], file: Path) -> str:
    for pattern, target in names.items():
        match = re.fullmatch(pattern, hf_name)
        if match:
            groups = match.groups()
            return target.format(i=groups[0] if groups and "{i}" in target else None, p=groups[-1] if groups else None)
    raise HFImportError(f"{file}: tensor {hf_name!r} is not part of the supported layout")


def _split_fused_phi3(tensors: dict[str, np.ndarray], config: ModelConfig) -> None:
    """Phi-3's qkv_proj rows are [q; k; v] and its gate_up_proj rows [gate; up] (its MLP chunks the
    projection in that order); the common layout wants them apart."""
    q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    for i in range(config.n_layers):
        qkv = tensors.pop(f"blk.{i}.attn_qkv.weight")
        if qkv.shape[0] != q_rows + 2 * kv_rows:
            raise HFImportError(f"layer {i}: qkv_proj has {qkv.shape[0]} rows, expected "
                                f"{q_rows} + 2 x {kv_rows} from the head counts")
        for name, part in zip("qkv", np.split(qkv, [q_rows, q_rows + kv_rows])):
            tensors[f"blk.{i}.attn_{name}.weight"] = part
        gate, up = np.split(tensors.pop(f"blk.{i}.ffn_gate_up.weight"), 2)
        tensors[f"blk.{i}.ffn_gate.weight"], tensors[f"blk.{i}.ffn_up.weight"] = gate, up


def _rope_parameters(c: dict) -> dict:
    """HF's rotary settings: `rope_scaling` (transformers 4) and `rope_parameters` (transformers 5,
    which also moves `rope_theta` and `partial_rotary_factor` into it), merged."""
    merged = {key: c[key] for key in ("rope_theta", "partial_rotary_factor") if key in c}
    return merged | (c.get("rope_scaling") or {}) | (c.get("rope_parameters") or {})


def _rope_scaling(c: dict) -> dict:
    """ModelConfig's rope fields from HF's `rope_scaling` (older configs name its kind `type`)."""
    scaling = _rope_parameters(c)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return {}
    if kind != "llama3":
        raise HFImportError(f"rope_scaling with rope_type {kind!r} is not supported; the supported one is "
                            "'llama3' (Llama 3.x), besides plain RoPE")
    try:
        return {
            "rope_scaling": "llama3",
            "rope_scaling_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            # HF falls back to max_position_embeddings when the key is absent.
            "rope_original_max_position": int(scaling.get("original_max_position_embeddings",
                                                          c["max_position_embeddings"])),
        }
    except KeyError as e:
        raise HFImportError(f"rope_scaling 'llama3' lacks {e.args[0]!r}: {scaling}") from None


def _refuse_unsupported_fields(c: dict, model_type: str, config_file: Path) -> None:
    """Config fields that would change the computation of a Llama-shape family in ways this decoder
    does not implement: refused by name rather than run as if absent."""
    unsupported = {
        "hidden_act": (c.get("hidden_act", "silu") != "silu", "the MLP must be SwiGLU with silu"),
        "attention_bias": (bool(c.get("attention_bias")), "biases on the attention projections"),
        "mlp_bias": (bool(c.get("mlp_bias")), "biases on the MLP projections"),
        "use_sliding_window": (bool(c.get("use_sliding_window")), "sliding-window attention"),
        "partial_rotary_factor": (_rope_parameters(c).get("partial_rotary_factor", 1.0) != 1.0,
                                  "rotary on part of each head"),
        # A window as long as the context never cuts anything off (Phi-3 mini 4k: 2047 of 4096 does).
        "sliding_window": ((c.get("sliding_window") or c["max_position_embeddings"]) < c["max_position_embeddings"]
                           and c.get("use_sliding_window", True), "sliding-window attention"),
    }
    for key, (present, what) in unsupported.items():
        if present:
            value = c.get(key, _rope_parameters(c).get(key))
            raise HFImportError(f"{config_file}: {key}={value!r} ({what}) is not supported for model_type "
                                f"{model_type!r}; supported families: {', '.join(SUPPORTED_MODEL_TYPES)}")


def _llama_config(c: dict, name: str, qkv_bias: bool = False, qk_norm: bool = False) -> ModelConfig:
    return ModelConfig(
        name=name,
        architecture="llama",
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        vocab_size=c["vocab_size"],
        d_model=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        d_ff=c["intermediate_size"],
        max_position=c["max_position_embeddings"],
        head_dim=c.get("head_dim") or 0,
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(_rope_parameters(c).get("rope_theta", 10000.0)),
        **_rope_scaling(c),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=_single_id(c.get("bos_token_id")),
        eos_token_id=_single_id(c.get("eos_token_id")),
    )


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
        bos_token_id=_single_id(c.get("bos_token_id")),
        eos_token_id=_single_id(c.get("eos_token_id")),
    )


def _single_id(value) -> int | None:
    """HF allows a list of eos ids; the first is the one the model emits."""
    return value[0] if isinstance(value, list) else value


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
        add_bos_token=bool(settings.get("add_bos_token", False)),
        chat_template=template if isinstance(template, str) else None,
    )
