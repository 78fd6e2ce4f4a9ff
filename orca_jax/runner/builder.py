"""One place that turns an EngineConfig into a warmed-up runner and an engine.

The offline `LLM` and the CLI (`generate`, `serve`) build through `build_engine`, a multi-host
follower through `build_runner` (it runs the leader's warm-up), so every setting of the config (the TOML's `[parallel]` section included) reaches
the runner the same way.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

import jax

from orca_jax.checkpoint.convert import ensure_pulled
from orca_jax.checkpoint.store import LoadedModel, load_model, read_model_config
from orca_jax.config import ConfigError, EngineConfig
from orca_jax.engine.engine import LLMEngine
from orca_jax.runner.model_runner import ModelRunner
from orca_jax.engine.step_plan import Buckets
from orca_jax.parallel.memory_plan import plan_memory
from orca_jax.parallel.multihost import DistributedConfig


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """Settings of a build that are not engine policy: compiled shapes and progress output."""

    token_buckets: Sequence[int] | None = None  # default: powers of two up to max_num_batched_tokens
    seq_buckets: Sequence[int] | None = None  # default: powers of two up to max_num_seqs
    show_progress: bool = True


def build_engine(config: EngineConfig, options: BuildOptions = BuildOptions(),
                 loaded: LoadedModel | None = None, devices: list | None = None,
                 distributed: DistributedConfig | None = None) -> LLMEngine:
    """Loads the model (pulled on first use), checks the layout, sizes the KV cache, compiles every
    bucket and returns the engine. Configuration errors raise before any device program is built. With
    `distributed` (this process is the leader), the followers must connect before warm-up, which
    they run in lockstep."""
    runner, loaded, max_model_len = build_runner(config, options, loaded, devices, distributed)
    if distributed is not None:
        from orca_jax.parallel.multihost import PlanSender

        runner.followers = PlanSender(distributed, runner.layout_key())
    runner.warm_up(show_progress=options.show_progress)
    return LLMEngine(config, loaded.config, runner, loaded.tokenizer, max_model_len)


def build_runner(config: EngineConfig, options: BuildOptions = BuildOptions(), loaded: LoadedModel | None = None,
                 devices: list | None = None, distributed: DistributedConfig | None = None):
    """The runner, not yet warmed up (a follower process compiles its own stages' programs, then
    runs the leader's warm-up step as a plan). Returns (runner, loaded model, max_model_len)."""
    if loaded is None:
        if distributed is None:  # several processes pulling into one folder would race: pull first
            ensure_pulled(config.model, log=lambda message: print(message, file=sys.stderr))
        stored = read_model_config(config.model)
        platform = devices[0].platform if devices else jax.default_backend()
        dtype = run_dtype(config.dtype, stored.dtype, platform)
        if dtype != stored.dtype and config.dtype == "auto" and options.show_progress:
            print(f"orca_jax: {stored.name} is stored in {stored.dtype}; running it in {dtype} on {platform}, "
                  f"where {stored.dtype} is slower (--dtype {stored.dtype} keeps it)", file=sys.stderr)
        loaded = load_model(config.model, dtype=dtype)
    elif config.dtype not in ("auto", loaded.config.dtype):
        raise ConfigError(f"dtype={config.dtype!r} but the given model is loaded in {loaded.config.dtype}; "
                          "load it with load_model(..., dtype=...)")
    if config.quantization != "none":
        loaded = quantized(loaded, config.quantization, options.show_progress)
    model_config = loaded.config
    max_model_len = config.max_model_len or model_config.max_position
    if max_model_len > model_config.max_position:
        raise ConfigError(f"max_model_len={max_model_len} exceeds {model_config.name}'s context length of "
                          f"{model_config.max_position} tokens; lower it")
    # Checks the layout (tp divisibility, stages) and sizes the pages per device from kv_cache_memory;
    # refuses a cache that cannot hold one max-length sequence.
    plan = plan_memory(model_config, config.parallel, page_size=config.cache.page_size, max_model_len=max_model_len,
                       kv_cache_memory=config.cache.kv_cache_memory, kv_cache_dtype=config.cache.kv_cache_dtype)
    runner = ModelRunner(loaded.model, num_pages=plan.num_pages, page_size=config.cache.page_size,
                         max_model_len=max_model_len, buckets=bucket_set(config, options),
                         attention_impl=config.attention_impl, parallel=config.parallel, devices=devices,
                         step_timeout=None if distributed is None else distributed.step_timeout,
                         kv_cache_dtype=config.cache.kv_cache_dtype)
    if options.show_progress:
        print(f"orca_jax: {model_config.name}, policy {config.scheduler.policy}, {runner.describe()}\n"
              f"{plan.one_line()}", file=sys.stderr)
    return runner, loaded, max_model_len


def quantized(loaded: LoadedModel, quantization: str, show_progress: bool) -> LoadedModel:
    """The loaded model with its matrices quantized (a copy: a model the caller passed in stays float)."""
    from orca_jax.model.quantization import quantize_decoder

    model, report = quantize_decoder(loaded.model, quantization, loaded.path)
    if show_progress:
        print(f"orca_jax: --quantization {quantization}: {report.one_line()}", file=sys.stderr)
    return dataclasses.replace(loaded, model=model)


def run_dtype(setting: str, stored: str, platform: str) -> str:
    """The dtype a model runs in (weights, activations, KV pages). An explicit setting wins. `auto`
    is the checkpoint's own dtype, except that a 16-bit checkpoint runs in float32 on CPU: XLA:CPU
    computes bfloat16 2-8x slower than float32 (DESIGN.md), and widening is exact, so it costs
    memory only. On a GPU `auto` keeps bfloat16, as a GPU user expects."""
    if setting != "auto":
        return setting
    return "float32" if platform == "cpu" else stored


def bucket_set(config: EngineConfig, options: BuildOptions) -> Buckets:
    limits = config.scheduler
    buckets = Buckets.for_limits(limits.max_num_batched_tokens, limits.max_num_seqs)
    if not (options.token_buckets or options.seq_buckets):
        return buckets
    buckets = Buckets(tokens=tuple(sorted(options.token_buckets or buckets.tokens)),
                      seqs=tuple(sorted(options.seq_buckets or buckets.seqs)))
    if buckets.tokens[-1] != limits.max_num_batched_tokens or buckets.seqs[-1] != limits.max_num_seqs:
        raise ConfigError(
            f"the largest buckets must equal the limits: tokens {buckets.tokens} must end at "
            f"max_num_batched_tokens={limits.max_num_batched_tokens}, seqs {buckets.seqs} at "
            f"max_num_seqs={limits.max_num_seqs}")
    return buckets

