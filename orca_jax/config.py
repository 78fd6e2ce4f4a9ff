"""Configuration: every engine setting declared once (`EngineConfig` and its sections, each field a
`setting()` with its default, description and unit), frozen and validated on construction. The
model's shape lives in model_config.py and reading TOML files in config_loading.py; both are
re-exported here, so `orca_jax.config` stays the one import for configuration.

Every field says its unit. This module does not import jax.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal

from orca_jax.config_loading import check_literal, check_positive, require
# Re-exported: one import for configuration (compilation_cache_dir: the attention backends import it from here).
from orca_jax.config_loading import ConfigError, from_dict, load_toml  # noqa: F401
from orca_jax.model_config import DType, ModelConfig, load_model_preset, model_config_to_toml  # noqa: F401
from orca_jax.model_config import model_preset_names  # noqa: F401
from orca_jax.paths import compilation_cache_dir, is_gguf_file, presets  # noqa: F401

# The folder above the package, for the tests and bench scripts (they run only from a source checkout).
# The package finds its own files through orca_jax/paths.py, which works installed too.
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "smollm2-135m-instruct"

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
# channel at load; "none" keeps the dtype's; "auto" is gguf for a .gguf file (as llama.cpp serves it),
# none for a checkpoint.
Quantization = Literal["auto", "none", "gguf", "int8"]
# How quantized matrices take their inputs (pallas_kernels/int8_activations.py): "int8" quantizes each
# activation row per 32-value block and multiplies with integer dot products (llama.cpp's method);
# "float32" multiplies the activations as they are by the exactly dequantized weights (the reference
# the fidelity tests compare against); "auto": int8 for gguf, float32 for int8 weights (activations_for).
QuantizationActivations = Literal["auto", "float32", "int8"]


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
QUANTIZATION_ACTIVATIONS_CHOICES: tuple[str, ...] = typing.get_args(QuantizationActivations)


def matmul_precision_for(setting: str, model_dtype: str) -> str:
    """The precision the model's matmuls are traced with. `auto`: a float32 model gets full float32
    products ("highest": on NVIDIA GPUs XLA's "default" would use TF32, 10-bit mantissas, and the
    float32 guarantees (docs/numerics.md) would not hold); a 16-bit model gets "default", 16-bit
    products summed in float32."""
    if setting != "auto":
        return setting
    return "highest" if model_dtype == "float32" else "default"


def quantization_for(setting: str, model: str) -> str:
    """The quantization a model runs with: `auto` is gguf for a .gguf file (its own blocks, as llama.cpp
    serves it: `--quantization none` asks for float weights), none for a checkpoint."""
    if setting != "auto":
        return setting
    return "gguf" if is_gguf_file(model) else "none"


def activations_for(setting: str, quantization: str) -> str:
    """How quantized matrices take their activations. `auto`: int8 for GGUF blocks (as llama.cpp
    serves them: fewer instructions per weight than dequantizing to float32, within the fidelity
    bound docs/quantization.md states), float32 for int8 weights (quantizing both sides of SmolLM2's
    int8 matrices fell under the 97% top-1 bar the defaults meet); "none" for an unquantized model."""
    if quantization == "none":
        return "none"
    if setting == "auto":
        return "int8" if quantization == "gguf" else "float32"
    return setting


def setting(default: Any = MISSING, description: str = "", *, unit: str | None = None,
            flag: str | None = None, keyword: str | None = None, default_factory: Any = MISSING) -> Any:
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
              "and the reserve; on CPU, device_memory_utilization x the host's free memory (MemAvailable, within "
              "a container's cgroup limit) after the parameters, at most what max_num_seqs sequences of "
              "max_model_len need (1GiB in a multi-process job)", unit="bytes")
    enable_prefix_caching: bool = setting(
        False, "share the KV pages of common prompt prefixes (paged, chunked, orca); --no-enable-prefix-caching "
               "turns a config file's true off")
    kv_cache_dtype: KVCacheDType = setting(
        "auto", "KV pages' dtype (auto: the model's, the reference); bfloat16 halves what attention reads and "
                "doubles the pages a kv_cache_memory budget holds, at a small cost in precision (docs/numerics.md)")
    device_memory_utilization: float = setting(
        0.9, "fraction of each accelerator's memory (as JAX reports it) for parameters and KV pages; the KV "
             "cache gets what the parameters leave, the rest is kept for activations and workspace. On CPU, the "
             "fraction of the host's free memory after the parameters that the KV cache takes",
        unit="fraction", flag="--gpu-memory-utilization")

    def __post_init__(self) -> None:
        check_positive(self, "page_size")
        if self.kv_cache_memory is not None:
            check_positive(self, "kv_cache_memory")
        fraction = self.device_memory_utilization
        require(isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction <= 1,
                 f"CacheConfig.device_memory_utilization must be a fraction in (0, 1], e.g. 0.9, "
                 f"got {self.device_memory_utilization!r}")
        check_literal(self, "kv_cache_dtype", KV_CACHE_DTYPE_CHOICES)


# Bytes per CPU device when kv_cache_memory is not given and the host's free memory cannot size the
# cache: in a multi-process job (every process must size the same cache), or where it is unknown.
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


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
        check_literal(self, "policy", SCHEDULING_POLICIES)
        require(isinstance(self.async_scheduling, bool),
                 f"SchedulerConfig: async_scheduling must be true or false, got {self.async_scheduling!r}")
        check_positive(self, "max_num_seqs", "max_num_batched_tokens")
        require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"SchedulerConfig: max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
            f"max_num_seqs={self.max_num_seqs} so every running request can decode each iteration",
        )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = setting(1, "devices each layer's weights are split over", unit="devices")
    pipeline_parallel_size: int = setting(1, "pipeline stages the layers are split into", unit="stages")

    def __post_init__(self) -> None:
        check_positive(self, "tensor_parallel_size", "pipeline_parallel_size")


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
        require(isinstance(self.disable_additional_properties, bool),
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
        check_literal(self, "method", SPECULATIVE_METHODS)
        check_positive(self, "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                        "disable_by_batch_size")
        require(self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"SpeculativeConfig.prompt_lookup_min={self.prompt_lookup_min} exceeds prompt_lookup_max="
                 f"{self.prompt_lookup_max}; make prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model":
            require(bool(self.model), "SpeculativeConfig.method='draft_model' needs `model`: the draft model's "
                                       "preset name or checkpoint directory")
        else:
            require(self.model is None, f"SpeculativeConfig.model={self.model!r} is set but method is "
                                         f"{self.method!r}; use method 'draft_model' or remove model")


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, declared once with setting() (here and in the sections below)."""

    model: str = setting(DEFAULT_MODEL, "preset name, checkpoint directory or .gguf file (served as it is)")
    max_model_len: int | None = setting(
        None, "tokens per sequence, prompt + output (none: the model's context length, lowered to what the KV "
              "cache holds where that is less; a given one the cache cannot hold is refused); a shorter one lets "
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
        "auto", "weights kept quantized on the device: gguf serves the GGUF's own blocks, int8 quantizes float "
                "weights per output channel at load, none keeps the dtype's; auto: gguf when the model is a .gguf "
                "file, none for a checkpoint (docs/quantization.md)")
    quantization_activations: QuantizationActivations = setting(
        "auto", "how quantized matrices take their inputs: int8 quantizes each activation row per 32 values and "
                "multiplies with integer dot products (llama.cpp's method); float32 multiplies them as they are by "
                "the exactly dequantized weights (the reference); auto: int8 for gguf, float32 for int8 weights "
                "(docs/quantization.md)")
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

    @property
    def effective_quantization(self) -> str:
        """`quantization` with auto resolved for the model (quantization_for): what runs."""
        return quantization_for(self.quantization, self.model)

    def __post_init__(self) -> None:
        check_literal(self, "load_format", LOAD_FORMAT_CHOICES)
        require(isinstance(self.dummy_seed, int) and not isinstance(self.dummy_seed, bool) and self.dummy_seed >= 0,
                 f"EngineConfig.dummy_seed must be a non-negative integer, got {self.dummy_seed!r}")
        check_literal(self, "attention_impl", ATTENTION_IMPL_CHOICES)
        check_literal(self, "dtype", DTYPE_CHOICES)
        check_literal(self, "matmul_precision", MATMUL_PRECISION_CHOICES)
        check_literal(self, "matmul_impl", MATMUL_IMPL_CHOICES)
        require(self.matmul_impl != "native" or self.parallel.tensor_parallel_size == 1,
                 "matmul_impl='native' multiplies whole matrices on each device: use tensor_parallel_size=1, "
                 "or matmul_impl='auto' (XLA's dot when the matrices are split)")
        check_literal(self, "quantization", QUANTIZATION_CHOICES)
        chosen = f"quantization={self.effective_quantization!r}" + (
            " (auto's choice for a .gguf file)" if self.quantization == "auto" else "")
        require(self.effective_quantization == "none" or self.parallel.tensor_parallel_size == 1,
                 f"{chosen} keeps whole quantized matrices on each device and does not split them: use "
                 "tensor_parallel_size=1 (pipeline_parallel_size may be larger), or quantization='none' to split "
                 "float weights over devices")
        check_literal(self, "quantization_activations", QUANTIZATION_ACTIVATIONS_CHOICES)
        # float32 is what float matrices take anyway; int8 needs quantized ones.
        require(self.effective_quantization != "none" or self.quantization_activations != "int8",
                 "quantization_activations='int8' quantizes the inputs of quantized matrices, and quantization='none' "
                 "has none: set quantization='gguf' or 'int8', or leave quantization_activations='auto'")
        if self.max_model_len is not None:
            check_positive(self, "max_model_len")
        require(
            not (self.cache.enable_prefix_caching and self.scheduler.policy == "static"),
            "enable_prefix_caching needs a policy that admits requests every iteration "
            "(orca, paged or chunked); 'static' would ignore it",
        )
