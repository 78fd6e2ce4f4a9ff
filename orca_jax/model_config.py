"""The shape of a model: `ModelConfig` (one dataclass for every supported family, its switches
validated on construction), the shipped presets (`configs/models/*.toml`, package data) and writing a
config back as TOML. This module does not import jax.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal

from orca_jax.config_loading import ConfigError, check_literal, check_positive, load_toml, require
from orca_jax.paths import presets

Architecture = Literal["llama", "gpt2"]
RopeScalingKind = Literal["llama3", "freq_factors", "linear"]
LayerType = Literal["sliding", "full"]
MlpActivation = Literal["silu", "gelu_tanh"]
DType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer. `architecture` picks the family:

    - "llama": RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases.
    - "gpt2": learned absolute positions, LayerNorm, GELU MLP, biases, multi-head attention
      (GPT-2 and GPT-3 share this shape).
    """

    name: str
    architecture: Architecture
    vocab_size: int  # tokens
    d_model: int  # width of the residual stream
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads; n_heads % n_kv_heads == 0 (GQA); equal for gpt2
    d_ff: int  # hidden width of the MLP
    max_position: int  # context length in tokens (prompt + generated)
    head_dim: int = 0  # 0 means d_model // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # RoPE base frequency (llama only)
    # RoPE frequency scaling of Llama 3.x (HF rope_scaling with rope_type "llama3"); None: plain RoPE.
    # Frequencies whose wavelength (tokens per turn) exceeds rope_original_max_position /
    # rope_low_freq_factor are divided by rope_scaling_factor; those below rope_original_max_position /
    # rope_high_freq_factor are kept; the ones between are interpolated smoothly.
    # "freq_factors" (GGUF files of Llama 3.x carry the same scaling as a `rope_freqs` tensor): pair i's
    # frequency is divided by rope_freq_factors[i], one factor per rotary pair (head_dim / 2 of them).
    rope_scaling: RopeScalingKind | None = None
    rope_scaling_factor: float | None = None  # dimensionless, e.g. 8.0 (Llama 3.1) or 32.0 (Llama 3.2)
    rope_low_freq_factor: float | None = None  # dimensionless, e.g. 1.0
    rope_high_freq_factor: float | None = None  # dimensionless, e.g. 4.0; > rope_low_freq_factor
    rope_original_max_position: int | None = None  # tokens: the context length of pre-training, e.g. 8192
    rope_freq_factors: tuple[float, ...] | None = None  # dimensionless divisors, for "freq_factors" only
    tie_word_embeddings: bool = True  # LM head shares the token embedding matrix
    # Llama-shape families differ from Llama in these switches (llama only):
    qkv_bias: bool = False  # biases on the q, k and v projections, none on the output (Qwen2, Qwen2.5)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before rotary (Qwen3, Gemma 3)
    # Sliding-window attention (Mistral, Gemma): a token sees the last `sliding_window` positions,
    # its own included, on the layers `layer_types` marks "sliding" (all of them when it is None).
    sliding_window: int | None = None  # tokens
    layer_types: tuple[LayerType, ...] | None = None  # one per layer; None: every layer "sliding" if windowed
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3); None: rope_theta
    # Gemma 2/3: GeGLU MLP, embeddings times sqrt(d_model), norms after attention and after the MLP as
    # well as before, attention scaled by 1/sqrt(query_pre_attn_scalar), logits soft-capped.
    mlp_activation: MlpActivation = "silu"  # "gelu_tanh": gate through tanh-approximated GELU
    embed_scale: bool = False  # embeddings multiplied by sqrt(d_model)
    post_norms: bool = False  # an RMSNorm on the attention's and on the MLP's output before the residual add
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: 1/sqrt(head_dim)
    attn_logit_softcap: float | None = None  # attention scores s -> cap * tanh(s / cap); None: off
    final_logit_softcap: float | None = None  # LM-head logits l -> cap * tanh(l / cap); None: off
    bos_token_id: int | None = None
    eos_token_id: int | None = None  # the end-of-sequence token (a chat template's `eos_token`)
    # Further ids that end a sequence as eos_token_id does: an instruct model's end of turn (Llama 3's
    # <|eot_id|>, Phi-3's <|end|>, Gemma's <end_of_turn>), which HF lists beside its eos and GGUF
    # names as eot/eom or llama.cpp finds by text. `eos_token_ids` is the whole set.
    extra_eos_token_ids: tuple[int, ...] = ()
    dtype: DType = "float32"  # parameters and activations; use float32 on CPU

    def __post_init__(self) -> None:
        check_literal(self, "architecture", typing.get_args(Architecture))
        check_literal(self, "dtype", typing.get_args(DType))
        check_positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_position")
        if self.head_dim == 0:
            require(
                self.d_model % self.n_heads == 0,
                f"ModelConfig {self.name!r}: d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "set head_dim explicitly",
            )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        check_positive(self, "head_dim")
        require(
            self.n_heads % self.n_kv_heads == 0,
            f"ModelConfig {self.name!r}: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}",
        )
        require(
            self.architecture != "gpt2" or self.n_kv_heads == self.n_heads,
            f"ModelConfig {self.name!r}: gpt2 uses multi-head attention; set n_kv_heads = n_heads = {self.n_heads}",
        )
        require(
            self.architecture != "llama" or self.head_dim % 2 == 0,
            f"ModelConfig {self.name!r}: RoPE needs an even head_dim, got {self.head_dim}",
        )
        require(
            self.architecture == "llama" or not (self.qkv_bias or self.qk_norm),
            f"ModelConfig {self.name!r}: qkv_bias and qk_norm are switches of the llama architecture; "
            "gpt2 has biases everywhere and no q/k norm",
        )
        self._check_family_switches()
        self._check_rope_scaling()
        require(self.norm_eps > 0, f"ModelConfig {self.name!r}: norm_eps must be > 0, got {self.norm_eps}")
        for token_name in ("bos_token_id", "eos_token_id"):
            token = getattr(self, token_name)
            require(
                token is None or 0 <= token < self.vocab_size,
                f"ModelConfig {self.name!r}: {token_name}={token} is outside the vocabulary [0, {self.vocab_size})",
            )
        # One spelling of the set, whatever the source listed: sorted, without duplicates or the eos itself.
        object.__setattr__(self, "extra_eos_token_ids",
                           tuple(sorted(set(self.extra_eos_token_ids) - {self.eos_token_id})))
        outside = [t for t in self.extra_eos_token_ids if not 0 <= t < self.vocab_size]
        require(not outside, f"ModelConfig {self.name!r}: extra_eos_token_ids {outside} are outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def _check_family_switches(self) -> None:
        check_literal(self, "mlp_activation", typing.get_args(MlpActivation))
        gemma_like = (self.sliding_window, self.layer_types, self.rope_local_theta, self.query_pre_attn_scalar,
                      self.attn_logit_softcap, self.final_logit_softcap)
        require(self.architecture == "llama" or (all(v is None for v in gemma_like) and not self.embed_scale
                                                  and not self.post_norms and self.mlp_activation == "silu"),
                 f"ModelConfig {self.name!r}: sliding windows, soft caps and the Gemma switches belong to the "
                 "llama architecture")
        require(self.sliding_window is None or self.sliding_window >= 1,
                 f"ModelConfig {self.name!r}: sliding_window must be >= 1 token or absent, got {self.sliding_window}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))  # TOML gives a list
            require(len(self.layer_types) == self.n_layers and set(self.layer_types) <= {"sliding", "full"},
                     f"ModelConfig {self.name!r}: layer_types needs one of 'sliding'/'full' per layer "
                     f"({self.n_layers}), got {list(self.layer_types)}")
            require(self.sliding_window is not None or "sliding" not in self.layer_types,
                     f"ModelConfig {self.name!r}: layer_types has sliding layers but sliding_window is not set")
        for name in ("rope_local_theta", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            require(value is None or value > 0, f"ModelConfig {self.name!r}: {name} must be > 0 or absent, got {value}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` in tokens, or None where it attends to everything."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[layer] == "full"):
            return None
        return self.sliding_window

    def _check_rope_scaling(self) -> None:
        llama3_fields = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                         "rope_original_max_position")
        fields_of = {None: (), "llama3": llama3_fields, "freq_factors": ("rope_freq_factors",),
                     "linear": ("rope_scaling_factor",)}
        require(self.rope_scaling in fields_of,
                 f"ModelConfig {self.name!r}: rope_scaling={self.rope_scaling!r}; the supported ones are "
                 "'llama3', 'freq_factors' and 'linear'")
        needed = fields_of[self.rope_scaling]
        stray = [f for f in llama3_fields + ("rope_freq_factors",) if f not in needed and getattr(self, f) is not None]
        require(not stray, f"ModelConfig {self.name!r}: {stray} are set but rope_scaling is {self.rope_scaling!r}; "
                            "set the rope_scaling they belong to or remove them")
        if self.rope_scaling is None:
            return
        require(self.architecture == "llama", f"ModelConfig {self.name!r}: rope_scaling needs architecture 'llama'")
        missing = [f for f in needed if getattr(self, f) is None]
        require(not missing, f"ModelConfig {self.name!r}: rope_scaling {self.rope_scaling!r} needs {missing}")
        if self.rope_scaling == "freq_factors":
            factors = self.rope_freq_factors
            require(len(factors) == self.head_dim // 2 and all(f > 0 for f in factors),
                     f"ModelConfig {self.name!r}: rope_freq_factors needs head_dim / 2 = {self.head_dim // 2} "
                     f"positive factors, got {len(factors)}")
            return
        if self.rope_scaling == "linear":
            require(self.rope_scaling_factor > 0, f"ModelConfig {self.name!r}: rope_scaling_factor must be > 0")
            return
        require(self.rope_scaling_factor > 0 and self.rope_original_max_position > 0,
                 f"ModelConfig {self.name!r}: rope_scaling_factor and rope_original_max_position must be > 0")
        require(0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                 f"ModelConfig {self.name!r}: need 0 < rope_low_freq_factor ({self.rope_low_freq_factor}) < "
                 f"rope_high_freq_factor ({self.rope_high_freq_factor})")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a sequence: eos_token_id and the extra ones."""
        return frozenset({self.eos_token_id, *self.extra_eos_token_ids}) - {None}

    @property
    def queries_per_kv_head(self) -> int:
        return self.n_heads // self.n_kv_heads

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (no arrays needed)."""
        d, f, dh = self.d_model, self.d_ff, self.head_dim
        attn = d * dh * (self.n_heads * 2 + self.n_kv_heads * 2)
        if self.architecture == "llama":
            layer = attn + 3 * d * f + 2 * d
            extra = d
        else:
            layer = attn + dh * (self.n_heads + 2 * self.n_kv_heads) + d + 2 * d * f + f + d + 4 * d
            extra = 2 * d + self.max_position * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * layer + extra + head


def model_preset_names() -> list[str]:
    return sorted(entry.name.removesuffix(".toml") for entry in presets("models").iterdir()
                  if entry.name.endswith(".toml"))


def load_model_preset(name: str) -> ModelConfig:
    """Loads the shipped preset `configs/models/<name>.toml`."""
    path = presets("models") / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown model preset {name!r}; available presets: {model_preset_names()}")
    return load_toml(ModelConfig, path)


def model_config_to_toml(config: ModelConfig) -> str:
    """Serialises a ModelConfig as TOML (flat scalars and float arrays, so a hand-written writer suffices)."""
    lines = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue  # TOML has no null; a missing optional key reads back as None
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        elif isinstance(value, tuple):  # float factors, token ids, or layer types (strings without quotes to escape)
            text = "[" + ", ".join(f'"{item}"' if isinstance(item, str) else repr(item) if isinstance(item, int)
                                   else repr(float(item)) for item in value) + "]"
        else:
            text = repr(value)
        lines.append(f"{f.name} = {text}")
    return "\n".join(lines) + "\n"
