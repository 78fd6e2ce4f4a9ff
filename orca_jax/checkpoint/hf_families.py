"""The Llama-shape families of Hugging Face checkpoints: per `model_type`, its tensor names (mapped
onto the common GGUF-named layout, checkpoint/layout.py), the ModelConfig switches its config.json
asks for, and what import must do to its tensors.

    llama         the base: RoPE, RMSNorm, SwiGLU, GQA, no biases
    qwen2         + q/k/v biases (Qwen2, Qwen2.5)
    qwen3         + RMSNorm over each head's q and k before rotary, no biases
    phi3          q/k/v and gate/up fused in one matrix each: split here; sliding window on every layer
    mistral       + sliding-window attention on every layer
    gemma2        GeGLU, embeddings x sqrt(d), norms after attention and MLP too, RMSNorm as x * (1 + w),
                  1/sqrt(query_pre_attn_scalar) scaling, attention and final logits soft-capped,
                  sliding and global layers alternating
    gemma3_text   gemma2 without soft caps, + q/k norms, sliding layers with their own RoPE base,
                  global ones with (linearly) scaled RoPE

A config field that would change the computation in a way the decoder does not implement is
refused by name, never run as if absent.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from orca_jax.config import ModelConfig


class HFImportError(ValueError):
    pass


# HF tensor name pattern -> GGUF name. "{i}" is the layer index, "{p}" the last group.
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
QK_NORM_NAMES = {r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.weight": "blk.{i}.attn_{p}_norm.weight"}
QWEN2_NAMES = LLAMA_NAMES | {r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.bias": "blk.{i}.attn_{p}.bias"}
PHI3_NAMES = {pattern: target for pattern, target in LLAMA_NAMES.items()
              if not re.search(r"[qkv]_proj|gate_proj|up_proj", pattern)} | {
    r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight": "blk.{i}.attn_qkv.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight": "blk.{i}.ffn_gate_up.weight",
}
# In Gemma, post_attention_layernorm norms the attention's output (in Llama it is the MLP's input norm).
GEMMA_NAMES = LLAMA_NAMES | {
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": "blk.{i}.post_attention_norm.weight",
    r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight": "blk.{i}.ffn_norm.weight",
    r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight": "blk.{i}.post_ffw_norm.weight",
}
NAMES = {"llama": LLAMA_NAMES, "qwen2": QWEN2_NAMES, "qwen3": LLAMA_NAMES | QK_NORM_NAMES, "phi3": PHI3_NAMES,
         "mistral": LLAMA_NAMES, "gemma2": GEMMA_NAMES, "gemma3_text": GEMMA_NAMES | QK_NORM_NAMES}
LLAMA_SHAPE_FAMILIES = tuple(NAMES)
GEMMA = ("gemma2", "gemma3_text")
WINDOWED = ("mistral", "phi3", *GEMMA)  # the families whose sliding windows the decoder implements


def llama_shape_config(c: dict, model_type: str, name: str, config_file: Path) -> ModelConfig:
    """The ModelConfig of a Llama-shape family's config.json (KeyError for a missing required key)."""
    _refuse_unsupported_fields(c, model_type, config_file)
    rope = rope_parameters(c)
    global_rope = rope.get("full_attention", rope)  # gemma3 (transformers 5): per layer type
    switches = {}
    if model_type == "qwen2":
        switches["qkv_bias"] = True
    if model_type in ("qwen3", "gemma3_text"):
        switches["qk_norm"] = True
    if model_type in WINDOWED and c.get("sliding_window"):
        switches["sliding_window"] = int(c["sliding_window"])
        switches["layer_types"] = _layer_types(c, model_type)
    if model_type in GEMMA:
        switches |= dict(mlp_activation="gelu_tanh", embed_scale=True, post_norms=True,
                         query_pre_attn_scalar=float(c["query_pre_attn_scalar"]),
                         attn_logit_softcap=_optional_float(c.get("attn_logit_softcapping")),
                         final_logit_softcap=_optional_float(c.get("final_logit_softcapping")))
    if model_type == "gemma3_text":
        local = rope.get("sliding_attention", {}).get("rope_theta", c.get("rope_local_base_freq", 10000.0))
        switches["rope_local_theta"] = float(local)
    return ModelConfig(
        name=name,
        architecture="llama",
        vocab_size=c["vocab_size"],
        d_model=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        d_ff=c["intermediate_size"],
        max_position=c["max_position_embeddings"],
        head_dim=c.get("head_dim") or 0,
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(global_rope.get("rope_theta", 10000.0)),
        **_rope_scaling(global_rope, c),
        # Gemma ties its head to the embeddings whatever the config says (and says so by default).
        tie_word_embeddings=bool(c.get("tie_word_embeddings", model_type in GEMMA)),
        bos_token_id=single_id(c.get("bos_token_id")),
        eos_token_id=single_id(c.get("eos_token_id")),
        **switches,
    )


def prepare_tensors(tensors: dict[str, np.ndarray], config: ModelConfig, model_type: str) -> None:
    """Brings a family's tensors to the common layout, in place."""
    if model_type == "phi3":
        split_fused_phi3(tensors, config)
    if model_type in GEMMA:
        # Gemma's RMSNorm multiplies by (1 + w) (in float32); the common layout stores the factor
        # itself, as llama.cpp's converter does for Gemma's GGUF files.
        for key in [k for k in tensors if k.endswith("norm.weight")]:
            tensors[key] = (tensors[key].astype(np.float32) + 1.0).astype(tensors[key].dtype)


def rope_parameters(c: dict) -> dict:
    """HF's rotary settings: `rope_scaling` (transformers 4) and `rope_parameters` (transformers 5,
    which also moves `rope_theta` and `partial_rotary_factor` into it), merged."""
    merged = {key: c[key] for key in ("rope_theta", "partial_rotary_factor") if key in c}
    return merged | (c.get("rope_scaling") or {}) | (c.get("rope_parameters") or {})


def single_id(value) -> int | None:
    """HF allows a list of eos ids; the first is the model's eos (a chat template's `eos_token`), the
    rest end a sequence too (id_list)."""
    ids = id_list(value)
    return ids[0] if ids else None


def id_list(value) -> list[int]:
    """An HF token id field (an id, a list of ids or null) as a list."""
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def _layer_types(c: dict, model_type: str) -> tuple[str, ...]:
    """Which layers slide: config.json's `layer_types` (transformers 5), else the family's pattern
    (Gemma 2: even layers; Gemma 3: all but every `sliding_window_pattern`-th; Mistral: all)."""
    n = c["num_hidden_layers"]
    if "layer_types" in c:
        kinds = {"sliding_attention": "sliding", "full_attention": "full"}
        unknown = sorted(set(c["layer_types"]) - set(kinds))
        if unknown:
            raise HFImportError(f"layer_types {unknown} are not supported; supported: {sorted(kinds)}")
        return tuple(kinds[kind] for kind in c["layer_types"])
    if model_type == "gemma2":
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(n))
    if model_type == "gemma3_text":
        pattern = c.get("sliding_window_pattern", 6)
        return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n))
    return ("sliding",) * n


def _rope_scaling(scaling: dict, c: dict) -> dict:
    """ModelConfig's rope fields from HF's rope settings (older configs name the kind `type`)."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {}
    if kind == "linear":
        return {"rope_scaling": "linear", "rope_scaling_factor": float(scaling["factor"])}
    if kind != "llama3":
        raise HFImportError(f"rope_scaling with rope_type {kind!r} is not supported; the supported ones are "
                            "'llama3' (Llama 3.x) and 'linear', besides plain RoPE")
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
    rope = rope_parameters(c)
    gemma = model_type in GEMMA
    activation_key = "hidden_activation" if gemma else "hidden_act"
    activation = "gelu_pytorch_tanh" if gemma else "silu"
    context = c.get("max_position_embeddings", 0)  # (missing: the config's construction names it)
    window = c.get("sliding_window") or context
    unsupported = {
        activation_key: (c.get(activation_key, activation) != activation, f"the MLP must gate with {activation}"),
        "attention_bias": (bool(c.get("attention_bias")), "biases on the attention projections"),
        "mlp_bias": (bool(c.get("mlp_bias")), "biases on the MLP projections"),
        "use_sliding_window": (bool(c.get("use_sliding_window")) and model_type not in WINDOWED,
                               "sliding-window attention"),
        "partial_rotary_factor": (rope.get("partial_rotary_factor", 1.0) != 1.0, "rotary on part of each head"),
        # A window as long as the context never cuts anything off.
        "sliding_window": (model_type not in WINDOWED and window < context
                           and c.get("use_sliding_window", True), "sliding-window attention"),
        "use_bidirectional_attention": (bool(c.get("use_bidirectional_attention")), "bidirectional attention"),
    }
    for key, (present, what) in unsupported.items():
        if present:
            raise HFImportError(f"{config_file}: {key}={c.get(key, rope.get(key))!r} ({what}) is not supported "
                                f"for model_type {model_type!r}; supported families: "
                                f"{', '.join(LLAMA_SHAPE_FAMILIES)}, gpt2")


def split_fused_phi3(tensors: dict[str, np.ndarray], config: ModelConfig) -> None:
    """Phi-3's qkv_proj rows are [q; k; v] and its gate_up_proj rows [gate; up] (its MLP chunks the
    projection in that order); the common layout wants them apart. Splits the layers `tensors` holds."""
    q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    for layer in sorted({name.split(".")[1] for name in tensors if name.endswith(".attn_qkv.weight")}):
        qkv = tensors.pop(f"blk.{layer}.attn_qkv.weight")
        if qkv.shape[0] != q_rows + 2 * kv_rows:
            raise HFImportError(f"layer {layer}: qkv_proj has {qkv.shape[0]} rows, expected "
                                f"{q_rows} + 2 x {kv_rows} from the head counts")
        for name, part in zip("qkv", np.split(qkv, [q_rows, q_rows + kv_rows])):
            tensors[f"blk.{layer}.attn_{name}.weight"] = part
    for layer in sorted({name.split(".")[1] for name in tensors if name.endswith(".ffn_gate_up.weight")}):
        gate, up = np.split(tensors.pop(f"blk.{layer}.ffn_gate_up.weight"), 2)
        tensors[f"blk.{layer}.ffn_gate.weight"], tensors[f"blk.{layer}.ffn_up.weight"] = gate, up
