"""Configuration: frozen dataclasses, filled from TOML files, validated on construction.

Every field says its unit. Files only fill the dataclasses; a key the dataclass does not have is an
error that names the key, the file and the keys that are allowed (a typo must never be ignored).
This module does not import jax.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal

# compilation_cache_dir is re-exported: the attention backends import it from here.
from orca_jax.paths import compilation_cache_dir, presets  # noqa: F401

# The folder above the package, for the tests and bench scripts (they run only from a source checkout).
# The package finds its own files through orca_jax/paths.py, which works installed too.
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "smollm2-135m-instruct"

Architecture = Literal["llama", "gpt2"]
RopeScalingKind = Literal["llama3", "freq_factors", "linear"]
LayerType = Literal["sliding", "full"]
MlpActivation = Literal["silu", "gelu_tanh"]
DType = Literal["float32", "bfloat16", "float16"]
KVCacheDType = Literal["auto", "float32", "bfloat16"]
SchedulingPolicy = Literal["static", "orca", "paged", "chunked"]  # each a class in engine/scheduler.py's POLICIES
AttentionImpl = Literal["auto", "native", "pallas", "xla"]
# How float matrices are multiplied (quantized ones always use their kernel): "native" has the CPU
# kernel compute calls of a few rows (decode steps) over the matrices transposed to rows, XLA the
# rest; "xla": XLA's dot throughout (the reference); auto: native on CPU for float32 at tp = 1.
MatmulImpl = Literal["auto", "native", "xla"]
DTypeSetting = Literal["auto", "float32", "bfloat16", "float16"]
# jax's names (jax.default_matmul_precision); auto = highest for float32 models, default otherwise.
MatmulPrecision = Literal["auto", "highest", "high", "default"]
SpeculativeMethod = Literal["ngram", "draft_model"]
LoadFormat = Literal["auto", "dummy"]  # auto: the checkpoint's weights; dummy: seeded random ones (vLLM's names)
# Weights kept quantized on the device (model/quantization.py): "gguf" serves a GGUF's own blocks, tensor
# by tensor (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), "int8" quantizes float weights per output
# channel at load; "none" keeps the dtype's.
Quantization = Literal["none", "gguf", "int8"]


# The choice lists, defined once: the CLI's choices, the TOML loader's checks and their errors use them.
SCHEDULING_POLICIES: tuple[str, ...] = typing.get_args(SchedulingPolicy)
ATTENTION_IMPL_CHOICES: tuple[str, ...] = typing.get_args(AttentionImpl)
MATMUL_IMPL_CHOICES: tuple[str, ...] = typing.get_args(MatmulImpl)
DTYPE_CHOICES: tuple[str, ...] = typing.get_args(DTypeSetting)
KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = typing.get_args(KVCacheDType)
MATMUL_PRECISION_CHOICES: tuple[str, ...] = typing.get_args(MatmulPrecision)
SPECULATIVE_METHODS: tuple[str, ...] = typing.get_args(SpeculativeMethod)
LOAD_FORMAT_CHOICES: tuple[str, ...] = typing.get_args(LoadFormat)
QUANTIZATION_CHOICES: tuple[str, ...] = typing.get_args(Quantization)


def matmul_precision_for(setting: str, model_dtype: str) -> str:
    """The precision the model's matmuls are traced with. `auto`: a float32 model gets full float32
    products ("highest": on NVIDIA GPUs XLA's "default" would use TF32, 10-bit mantissas, and the
    float32 guarantees (docs/numerics.md) would not hold); a 16-bit model gets "default", 16-bit
    products summed in float32."""
    if setting != "auto":
        return setting
    return "highest" if model_dtype == "float32" else "default"


class ConfigError(ValueError):
    """A configuration value or file is wrong; the message says which and how to fix it."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_literal(obj: Any, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    _require(value in allowed, f"{type(obj).__name__}.{name}={value!r}; choose one of {list(allowed)}")


def _check_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(
            isinstance(value, int) and not isinstance(value, bool) and value > 0,
            f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}",
        )


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
    eos_token_id: int | None = None
    dtype: DType = "float32"  # parameters and activations; use float32 on CPU

    def __post_init__(self) -> None:
        _check_literal(self, "architecture", typing.get_args(Architecture))
        _check_literal(self, "dtype", typing.get_args(DType))
        _check_positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_position")
        if self.head_dim == 0:
            _require(
                self.d_model % self.n_heads == 0,
                f"ModelConfig {self.name!r}: d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "set head_dim explicitly",
            )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        _check_positive(self, "head_dim")
        _require(
            self.n_heads % self.n_kv_heads == 0,
            f"ModelConfig {self.name!r}: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}",
        )
        _require(
            self.architecture != "gpt2" or self.n_kv_heads == self.n_heads,
            f"ModelConfig {self.name!r}: gpt2 uses multi-head attention; set n_kv_heads = n_heads = {self.n_heads}",
        )
        _require(
            self.architecture != "llama" or self.head_dim % 2 == 0,
            f"ModelConfig {self.name!r}: RoPE needs an even head_dim, got {self.head_dim}",
        )
        _require(
            self.architecture == "llama" or not (self.qkv_bias or self.qk_norm),
            f"ModelConfig {self.name!r}: qkv_bias and qk_norm are switches of the llama architecture; "
            "gpt2 has biases everywhere and no q/k norm",
        )
        self._check_family_switches()
        self._check_rope_scaling()
        _require(self.norm_eps > 0, f"ModelConfig {self.name!r}: norm_eps must be > 0, got {self.norm_eps}")
        for token_name in ("bos_token_id", "eos_token_id"):
            token = getattr(self, token_name)
            _require(
                token is None or 0 <= token < self.vocab_size,
                f"ModelConfig {self.name!r}: {token_name}={token} is outside the vocabulary [0, {self.vocab_size})",
            )

    def _check_family_switches(self) -> None:
        _check_literal(self, "mlp_activation", typing.get_args(MlpActivation))
        gemma_like = (self.sliding_window, self.layer_types, self.rope_local_theta, self.query_pre_attn_scalar,
                      self.attn_logit_softcap, self.final_logit_softcap)
        _require(self.architecture == "llama" or (all(v is None for v in gemma_like) and not self.embed_scale
                                                  and not self.post_norms and self.mlp_activation == "silu"),
                 f"ModelConfig {self.name!r}: sliding windows, soft caps and the Gemma switches belong to the "
                 "llama architecture")
        _require(self.sliding_window is None or self.sliding_window >= 1,
                 f"ModelConfig {self.name!r}: sliding_window must be >= 1 token or absent, got {self.sliding_window}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))  # TOML gives a list
            _require(len(self.layer_types) == self.n_layers and set(self.layer_types) <= {"sliding", "full"},
                     f"ModelConfig {self.name!r}: layer_types needs one of 'sliding'/'full' per layer "
                     f"({self.n_layers}), got {list(self.layer_types)}")
            _require(self.sliding_window is not None or "sliding" not in self.layer_types,
                     f"ModelConfig {self.name!r}: layer_types has sliding layers but sliding_window is not set")
        for name in ("rope_local_theta", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"ModelConfig {self.name!r}: {name} must be > 0 or absent, got {value}")

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
        _require(self.rope_scaling in fields_of,
                 f"ModelConfig {self.name!r}: rope_scaling={self.rope_scaling!r}; the supported ones are "
                 "'llama3', 'freq_factors' and 'linear'")
        needed = fields_of[self.rope_scaling]
        stray = [f for f in llama3_fields + ("rope_freq_factors",) if f not in needed and getattr(self, f) is not None]
        _require(not stray, f"ModelConfig {self.name!r}: {stray} are set but rope_scaling is {self.rope_scaling!r}; "
                            "set the rope_scaling they belong to or remove them")
        if self.rope_scaling is None:
            return
        _require(self.architecture == "llama", f"ModelConfig {self.name!r}: rope_scaling needs architecture 'llama'")
        missing = [f for f in needed if getattr(self, f) is None]
        _require(not missing, f"ModelConfig {self.name!r}: rope_scaling {self.rope_scaling!r} needs {missing}")
        if self.rope_scaling == "freq_factors":
            factors = self.rope_freq_factors
            _require(len(factors) == self.head_dim // 2 and all(f > 0 for f in factors),
                     f"ModelConfig {self.name!r}: rope_freq_factors needs head_dim / 2 = {self.head_dim // 2} "
                     f"positive factors, got {len(factors)}")
            return
        if self.rope_scaling == "linear":
            _require(self.rope_scaling_factor > 0, f"ModelConfig {self.name!r}: rope_scaling_factor must be > 0")
            return
        _require(self.rope_scaling_factor > 0 and self.rope_original_max_position > 0,
                 f"ModelConfig {self.name!r}: rope_scaling_factor and rope_original_max_position must be > 0")
        _require(0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                 f"ModelConfig {self.name!r}: need 0 < rope_low_freq_factor ({self.rope_low_freq_factor}) < "
                 f"rope_high_freq_factor ({self.rope_high_freq_factor})")

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


def setting(default: Any = dataclasses.MISSING, description: str = "", *, unit: str | None = None,
            flag: str | None = None, keyword: str | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """Declares one engine setting, a field of EngineConfig or of one of its sections: its default, its
    description (the CLI's --help and docs/configuration.md) and unit, and its CLI flag and `LLM`
    keyword where they are not the field's name (--field-name, field_name), as vLLM spells them.
    orca_jax/engine_args.py derives the flags and the keywords from these declarations; the TOML keys
    are the field names themselves (from_dict). A section declared with setting() is one setting
    given whole (a JSON flag, a dict keyword, a TOML table); a section without is a TOML table whose
    fields are settings each."""
    metadata = {"description": description, "unit": unit, "flag": flag, "keyword": keyword}
    return field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = setting(16, "tokens per KV page", unit="tokens")
    kv_cache_memory: int | None = setting(
        None, "KV cache per device (its stage's layers, its share of the heads), e.g. 1GiB, 512MiB or bytes; "
              "none: on an accelerator, what device_memory_utilization x its memory leaves after the parameters "
              "and the reserve, on CPU 1GiB", unit="bytes")
    enable_prefix_caching: bool = setting(
        False, "share the KV pages of common prompt prefixes (paged, chunked, orca); --no-enable-prefix-caching "
               "turns a config file's true off")
    kv_cache_dtype: KVCacheDType = setting(
        "auto", "KV pages' dtype (auto: the model's, the reference); bfloat16 halves what attention reads and "
                "doubles the pages a kv_cache_memory budget holds, at a small cost in precision (docs/numerics.md)")
    device_memory_utilization: float = setting(
        0.9, "fraction of each accelerator's memory (as JAX reports it) for parameters and KV pages; the KV "
             "cache gets what the parameters leave, the rest is kept for activations and workspace. Ignored on CPU",
        unit="fraction", flag="--gpu-memory-utilization")

    def __post_init__(self) -> None:
        _check_positive(self, "page_size")
        if self.kv_cache_memory is not None:
            _check_positive(self, "kv_cache_memory")
        fraction = self.device_memory_utilization
        _require(isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction <= 1,
                 f"CacheConfig.device_memory_utilization must be a fraction in (0, 1], e.g. 0.9, "
                 f"got {self.device_memory_utilization!r}")
        _check_literal(self, "kv_cache_dtype", KV_CACHE_DTYPE_CHOICES)


DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # bytes per CPU device when kv_cache_memory is not given


def kv_page_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype KV pages are kept in: `auto` follows the model."""
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    policy: SchedulingPolicy = setting("chunked", "scheduling policy (docs/scheduling.md)", flag="--policy",
                                       keyword="scheduling_policy")
    max_num_seqs: int = setting(32, "requests running at once", unit="requests")
    max_num_batched_tokens: int = setting(512, "tokens in one forward pass (prefill + decode)", unit="tokens")
    async_scheduling: bool = setting(
        True, "plan and dispatch each step while the one before computes, hiding host work (vLLM's async "
              "scheduling; with one pipeline stage and no draft model; the outputs are the same either way; "
              "--no-async-scheduling steps one at a time)")

    def __post_init__(self) -> None:
        _check_literal(self, "policy", SCHEDULING_POLICIES)
        _require(isinstance(self.async_scheduling, bool),
                 f"SchedulerConfig: async_scheduling must be true or false, got {self.async_scheduling!r}")
        _check_positive(self, "max_num_seqs", "max_num_batched_tokens")
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"SchedulerConfig: max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
            f"max_num_seqs={self.max_num_seqs} so every running request can decode each iteration",
        )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = setting(1, "devices each layer's weights are split over", unit="devices")
    pipeline_parallel_size: int = setting(1, "pipeline stages the layers are split into", unit="stages")

    def __post_init__(self) -> None:
        _check_positive(self, "tensor_parallel_size", "pipeline_parallel_size")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Defaults for constrained requests (vLLM's --structured-outputs-config); a request's own
    `structured_outputs` options override them."""

    # True keeps a small model from running on inventing keys or digits until max_tokens cuts the JSON.
    disable_additional_properties: bool = setting(
        True, "an object schema that does not say additionalProperties generates only the properties it lists, "
              "unbounded numbers get JSON's interoperable range and json_object is bounded (engine/json_schema.py); "
              "false: JSON Schema's letter (any extra key, any number)")

    def __post_init__(self) -> None:
        _require(isinstance(self.disable_additional_properties, bool),
                 f"disable_additional_properties must be true or false, got {self.disable_additional_properties!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config): each step proposes up to
    `num_speculative_tokens` draft tokens per decoding request and verifies them in the same forward
    pass, so one step can emit several tokens. Outputs keep the target model's distribution.

    - "ngram": prompt lookup. The last n tokens of the request (prompt_lookup_max >= n >=
      prompt_lookup_min) are searched for earlier in its prompt and output; the tokens that followed
      the latest match are the drafts. Proposed on the device, inside the step.
    - "draft_model": a smaller model with the target's tokenizer proposes the drafts (`model`).
    """

    method: SpeculativeMethod = setting(
        "ngram", "ngram: prompt lookup on the device; draft_model: a smaller model proposes the drafts")
    num_speculative_tokens: int = setting(4, "draft tokens per request and step, at most", unit="tokens")
    prompt_lookup_max: int = setting(4, "the longest suffix n-gram searched (ngram)", unit="tokens")
    # 1, unlike vLLM's default: after a token the model changed (a fixed typo), the next copied token
    # matches alone a step before any pair of tokens does (copy-heavy workload: 258 steps against 307
    # at 2), and drafts that fail cost little: the draft policy stops verifying them (engine/speculation.py)
    prompt_lookup_min: int = setting(1, "the shortest n-gram that counts as a match (ngram)", unit="tokens")
    model: str | None = setting(None, "draft_model: the draft's preset name or checkpoint directory")
    # A larger step is compute-bound on a CPU, where every draft row costs as much as a decode
    # (docs/speculative-decoding.md); on a GPU rows stay cheap far longer.
    disable_by_batch_size: int = setting(
        8, "a step's rows (decodes + drafts) stay within this many: drafts fill only the rows the decodes "
           "leave, and none are given while this many requests decode; raise it on a GPU", unit="rows")

    def __post_init__(self) -> None:
        _check_literal(self, "method", SPECULATIVE_METHODS)
        _check_positive(self, "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                        "disable_by_batch_size")
        _require(self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"SpeculativeConfig.prompt_lookup_min={self.prompt_lookup_min} exceeds prompt_lookup_max="
                 f"{self.prompt_lookup_max}; make prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model":
            _require(bool(self.model), "SpeculativeConfig.method='draft_model' needs `model`: the draft model's "
                                       "preset name or checkpoint directory")
        else:
            _require(self.model is None, f"SpeculativeConfig.model={self.model!r} is set but method is "
                                         f"{self.method!r}; use method 'draft_model' or remove model")


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, declared once with setting() (here and in the sections below)."""

    model: str = setting(DEFAULT_MODEL, "preset name or checkpoint directory")
    max_model_len: int | None = setting(
        None, "tokens per sequence, prompt + output (none: the model's context length); a shorter one lets "
              "orca/static reserve less KV per request", unit="tokens")
    dtype: DTypeSetting = setting(
        "auto", "weights, activations and KV pages (auto: the checkpoint's own dtype, but float32 on CPU, where "
                "bfloat16 is slower; bfloat16 halves weights and KV pages)")
    attention_impl: AttentionImpl = setting(
        "auto", "who computes attention (docs/kernels.md): auto = the native C++ kernel on CPU (XLA if it cannot "
                "be built), the Pallas kernel on GPU; native, pallas (interpret mode on CPU) or xla force one")
    matmul_precision: MatmulPrecision = setting(
        "auto", "precision of the model's matmuls (auto: highest for float32 models, i.e. no TF32 on GPUs; "
                "default for 16-bit ones, 16-bit products summed in float32); see matmul_precision_for")
    matmul_impl: MatmulImpl = setting(
        "auto", "float matrices' matmuls (auto: native on CPU for float32 at tp 1; native: the CPU kernel for "
                "decode-sized calls over the matrices as rows, XLA for the rest; xla: XLA's dot, the reference)")
    quantization: Quantization = setting(
        "none", "weights kept quantized on the device (none: the dtype's): gguf serves the GGUF's own blocks, "
                "int8 quantizes float weights per output channel at load (docs/quantization.md)")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = setting(
        default_factory=StructuredOutputsConfig, flag="--structured-outputs-config",
        keyword="structured_outputs_config",
        description="defaults for constrained requests (vLLM's flag), e.g. '{\"disable_additional_properties\": "
                    "false}' lets objects whose schema does not say additionalProperties carry invented keys and "
                    "json_object be unbounded (default true: only the keys a schema lists)")
    speculative_config: SpeculativeConfig | None = setting(
        None, "speculative decoding (vLLM's flag; none: off), e.g. '{\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}' "
              "(docs/speculative-decoding.md)")
    load_format: LoadFormat = setting(
        "auto", "auto: the checkpoint's weights; dummy: seeded random weights of the model's shapes (a preset such "
                "as llama-3-70b, or a checkpoint's model.toml), made on each device for its own shard: try a layout "
                "without its weights; the outputs are meaningless")
    dummy_seed: int = setting(0, "seed of the dummy weights: the same seed, the same weights, whatever the layout")
    tokenizer: str | None = setting(
        None, "use this checkpoint's tokenizer (name or directory) instead of the model's own")

    def __post_init__(self) -> None:
        _check_literal(self, "load_format", LOAD_FORMAT_CHOICES)
        _require(isinstance(self.dummy_seed, int) and not isinstance(self.dummy_seed, bool) and self.dummy_seed >= 0,
                 f"EngineConfig.dummy_seed must be a non-negative integer, got {self.dummy_seed!r}")
        _check_literal(self, "attention_impl", ATTENTION_IMPL_CHOICES)
        _check_literal(self, "dtype", DTYPE_CHOICES)
        _check_literal(self, "matmul_precision", MATMUL_PRECISION_CHOICES)
        _check_literal(self, "matmul_impl", MATMUL_IMPL_CHOICES)
        _require(self.matmul_impl != "native" or self.parallel.tensor_parallel_size == 1,
                 "matmul_impl='native' multiplies whole matrices on each device: use tensor_parallel_size=1, "
                 "or matmul_impl='auto' (XLA's dot when the matrices are split)")
        _check_literal(self, "quantization", QUANTIZATION_CHOICES)
        _require(self.quantization == "none" or self.parallel.tensor_parallel_size == 1,
                 f"quantization={self.quantization!r} keeps whole quantized matrices on each device and does not "
                 "split them: use tensor_parallel_size=1 (pipeline_parallel_size may be larger), or "
                 "quantization='none' to split float weights over devices")
        if self.max_model_len is not None:
            _check_positive(self, "max_model_len")
        _require(
            not (self.cache.enable_prefix_caching and self.scheduler.policy == "static"),
            "enable_prefix_caching needs a policy that admits requests every iteration "
            "(orca, paged or chunked); 'static' would ignore it",
        )


def from_dict(cls: type, data: dict[str, Any], source: str) -> Any:
    """Builds dataclass `cls` from `data`, recursing into nested dataclass fields.

    Raises ConfigError naming `source` for unknown keys, missing required keys and wrong types.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a table for {cls.__name__}, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {unknown} for {cls.__name__}; allowed keys are {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        hint = _optional_dataclass(hints[name]) if isinstance(value, dict) else hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = from_dict(hint, value, f"{source} [{name}]")
        else:
            kwargs[name] = _check_type(value, hint, f"{source}: {cls.__name__}.{name}")
    missing = [
        f.name
        for f in fields.values()
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {missing} for {cls.__name__}")
    return cls(**kwargs)


def _optional_dataclass(hint: Any) -> Any:
    """The dataclass of an optional section (`SpeculativeConfig | None`), else the hint itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        classes = [k for k in typing.get_args(hint) if dataclasses.is_dataclass(k)]
        return classes[0] if classes else hint
    return hint


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Checks a TOML scalar against a field's type; ints are accepted where floats are expected."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value  # the dataclass validates the choice with a better message
    allowed = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    for kind in allowed:
        if kind is type(None) and value is None:
            return value
        if typing.get_origin(kind) is Literal and isinstance(value, str):
            return value  # as above: the dataclass names the choices
        if typing.get_origin(kind) is tuple and isinstance(value, list):
            # A TOML array; tuples keep the frozen dataclass hashable. tuple[float, ...] or of a Literal.
            item_hint = typing.get_args(kind)[0]
            return tuple(_check_type(item, item_hint, f"{where}[{i}]") for i, item in enumerate(value))
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind in (int, str, bool) and type(value) is kind:
            return value
    names = [getattr(k, "__name__", str(k)) for k in allowed]
    raise ConfigError(f"{where} = {value!r} has type {type(value).__name__}; expected {' or '.join(names)}")


def load_toml(cls: type, path: str | Path | Traversable) -> Any:
    """`path`: a file, or a preset inside the package (paths.presets)."""
    if isinstance(path, str):
        path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    return from_dict(cls, data, str(path))


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
        elif isinstance(value, tuple):  # float factors, or layer types (strings without quotes to escape)
            text = "[" + ", ".join(f'"{item}"' if isinstance(item, str) else repr(float(item)) for item in value) + "]"
        else:
            text = repr(value)
        lines.append(f"{f.name} = {text}")
    return "\n".join(lines) + "\n"
