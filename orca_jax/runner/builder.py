"""One place that turns an EngineConfig into a warmed-up runner and an engine.

The offline `LLM` and the CLI (`generate`, `serve`) build through `build_engine`, a multi-host
follower through `build_runner` (it runs the leader's warm-up), so every setting of the config (the TOML's `[parallel]` section included) reaches
the runner the same way.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp

from orca_jax.checkpoint.convert import ensure_pulled
from orca_jax.checkpoint.dummy import DummyWeights
from orca_jax.checkpoint.store import (CheckpointWeights, LoadedModel, load_model, open_model, read_model_config,
                                       resolve_checkpoint_dir)
from orca_jax.config import DEFAULT_CPU_KV_CACHE_MEMORY, ConfigError, EngineConfig, ModelConfig, kv_page_dtype
from orca_jax.parallel.layout import kv_heads_for_tp
from orca_jax.engine.engine import LLMEngine
from orca_jax.host_memory import available_host_memory
from orca_jax.runner.model_runner import ModelRunner
from orca_jax.runner.speculation import DraftModelProposer, NgramProposer
from orca_jax.engine.step_plan import Buckets
from orca_jax.optional import import_optional
from orca_jax.paths import is_gguf_file
from orca_jax.tokenizer import Tokenizer
from orca_jax.model.decoder import abstract_decoder
from orca_jax.parallel.memory_plan import plan_memory
from orca_jax.parallel.plan_cli import resolve_model_config
from orca_jax.parallel.multihost import DistributedConfig, PlanSender, job_devices

if TYPE_CHECKING:
    from orca_jax.checkpoint.gguf_weights import GGUFWeights


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
    `distributed` (this process is the leader), the followers must show the same layout before
    warm-up, which they run in lockstep."""
    runner, loaded, max_model_len = build_runner(config, options, loaded, devices, distributed)
    if distributed is not None:
        runner.followers = PlanSender(distributed, runner.layout_settings(), runner.last_stage_process)
    runner.warm_up(show_progress=options.show_progress)
    # No gc.freeze here: it would freeze the caller's whole heap (a notebook's cycles never collected
    # again). The server, whose process is the engine's own, calls freeze_start_up_objects.
    return LLMEngine(config, loaded.config, runner, loaded.tokenizer, max_model_len)


def freeze_start_up_objects() -> None:
    """Moves every object alive after start-up (the model's modules, the tokenizer, jax's caches: about
    180,000 with the tiny model) out of the garbage collector's sight, as vLLM's engine does. Python's
    full collections otherwise walk them all, and a full collection comes every few dozen steps when
    many requests decode: at 256 requests they took 1.7 ms a step, a quarter of the host's work
    (bench/bench_host_overhead.py, AMD EPYC Zen 4). Frozen objects are still freed when their last
    reference goes (the engine holds no reference cycle); only cycles among them are never collected.
    The garbage of start-up is collected first.

    It freezes everything in the process, not only the engine's objects, so only a process that is
    the engine's own calls it: `orca-jax serve`, once the engine is built. `LLM` does not (a caller
    may, after building it: docs/offline.md)."""
    gc.collect()
    gc.freeze()


def build_runner(config: EngineConfig, options: BuildOptions = BuildOptions(), loaded: LoadedModel | None = None,
                 devices: list | None = None, distributed: DistributedConfig | None = None):
    """The runner, not yet warmed up (a follower process compiles its own stages' programs, then
    runs the leader's warm-up step as a plan). Returns (runner, loaded model, max_model_len)."""
    # Before this build loads anything: the memory plan takes the weights out of it. (A model passed
    # in holds its arrays already, so they count twice: the cache errs small.)
    free_host_memory = available_host_memory()
    weights = None  # a given model's own arrays
    if devices is None and distributed is not None:
        devices = job_devices(distributed)
    if loaded is None:
        platform = devices[0].platform if devices else jax.default_backend()
        loaded, weights = _load(config, options, platform, pull=distributed is None)
    elif config.dtype not in ("auto", loaded.config.dtype):
        raise ConfigError(f"dtype={config.dtype!r} but the given model is loaded in {loaded.config.dtype}; "
                          "load it with load_model(..., dtype=...)")
    quantization = config.effective_quantization
    if quantization != "none":
        if config.load_format == "dummy":
            raise ConfigError(f"quantization={quantization!r} quantizes a checkpoint's weights; with "
                              "load_format='dummy' use quantization='none'")
        # The quantized model holds its own arrays (tensor_parallel_size is 1): quantizing reads the
        # float parameters it needs from the checkpoint or file, not the per-stage restore.
        loaded = quantized(loaded, weights or stored_weights(loaded.path), quantization,
                           options.show_progress, config.quantization_activations)
        weights = None
    model_config = loaded.config
    if config.max_model_len is not None and config.max_model_len > model_config.max_position:
        raise ConfigError(f"max_model_len={config.max_model_len} exceeds {model_config.name}'s context length of "
                          f"{model_config.max_position} tokens; lower it")
    # Checks the layout (tp divisibility, stages) and sizes the pages per device (kv_cache_memory, the
    # devices' memory, or on CPU the host's); refuses a layout that does not fit, or a cache that
    # cannot hold one sequence of a given max_model_len, before the target's weights are placed. Not
    # given, max_model_len is the model's context or, where that does not fit, what does.
    cache = config.cache
    device_memory = _device_memory(devices)
    kv_cache_memory = cache.kv_cache_memory
    host_memory = max_num_seqs = None
    if kv_cache_memory is None and device_memory is None:
        # On CPU the budget is the engine's choice, not the user's: host memory that max_num_seqs
        # sequences can never use stays the host's (on an accelerator it is the engine's anyway).
        max_num_seqs = config.scheduler.max_num_seqs
        # Each host's free memory differs, and the processes of a multi-process job must size the
        # same cache (they compare their page counts at start-up): there the fixed default sizes it.
        host_memory = free_host_memory if distributed is None else None
        if host_memory is None:
            kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY
    proposer = proposer_of(config, loaded)
    plan = plan_memory(model_config, config.parallel, page_size=cache.page_size, max_model_len=config.max_model_len,
                       device_memory=device_memory, kv_cache_memory=kv_cache_memory, host_memory=host_memory,
                       max_num_seqs=max_num_seqs,
                       kv_cache_dtype=cache.kv_cache_dtype, memory_utilization=cache.device_memory_utilization,
                       loaded_model=loaded.model if quantization != "none" else None,
                       draft_kv_bytes_per_page=draft_kv_bytes_per_page(proposer, config))
    if plan.lowered_from is not None:  # shown even without progress output: it changes what requests may ask
        print(f"orca_jax: {plan.lowered_note()}", file=sys.stderr)
    max_model_len = plan.max_model_len
    runner = ModelRunner(loaded.model, config, num_pages=plan.num_pages, max_model_len=max_model_len,
                         buckets=bucket_set(config, options), devices=devices,
                         step_timeout=None if distributed is None else distributed.step_timeout,
                         proposer=proposer, weights=weights)
    if options.show_progress:
        print(f"orca_jax: {model_config.name}, policy {config.scheduler.policy}, {runner.describe()}\n"
              f"{plan.one_line()}", file=sys.stderr)
    return runner, loaded, max_model_len


def proposer_of(config: EngineConfig, target: LoadedModel) -> NgramProposer | DraftModelProposer | None:
    """The device's draft proposer for the config's speculative decoding (None: none). A draft
    model is loaded whole (it is small), in the target's dtype, and must share its tokenizer."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer.from_config(spec)
    if config.load_format == "dummy":
        raise ConfigError("speculative_config.method='draft_model' needs the target's real tokenizer and weights; "
                          "use load_format='auto', or method 'ngram' with dummy weights")
    draft = load_model(resolve_checkpoint_dir(spec.model), dtype=target.config.dtype)
    check_same_tokenizer(spec.model, draft, target)
    return DraftModelProposer(spec.num_speculative_tokens, spec.model, draft.config, draft.model)


def check_same_tokenizer(name: str, draft: LoadedModel, target: LoadedModel) -> None:
    """A draft model proposes token ids of the target's vocabulary: same size, same tokens."""
    where = f"speculative_config.model={name!r} ({draft.config.name})"
    if draft.config.vocab_size != target.config.vocab_size:
        raise ConfigError(f"{where} has a vocabulary of {draft.config.vocab_size} tokens but the target "
                          f"{target.config.name} has {target.config.vocab_size}: a draft model must share the "
                          "target's tokenizer; pick a draft of the target's family")
    if draft.tokenizer is None or target.tokenizer is None:
        missing = draft.path if draft.tokenizer is None else target.path
        raise ConfigError(f"{where}: {missing} has no tokenizer.json, so the draft's tokenizer cannot be checked "
                          f"against the target {target.config.name}'s; give checkpoints with their tokenizers")
    draft_vocab, target_vocab = (t.hf.get_vocab(with_added_tokens=True) for t in (draft.tokenizer, target.tokenizer))
    if draft_vocab != target_vocab:
        # By id, then token: the same examples in every run (set order follows string hashing)
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda item: (item[1], item[0]))[:3]
        raise ConfigError(f"{where} has another tokenizer than the target {target.config.name} (same size, different "
                          f"tokens, e.g. {differ}): a draft model must share the target's tokenizer")


def draft_kv_bytes_per_page(proposer, config: EngineConfig) -> int:
    """A draft model's KV bytes per page on each device of the last stage, which holds the draft's
    pages beside the target's, as many (its parameters are small and left to the reserve); 0 without
    a draft model."""
    if not isinstance(proposer, DraftModelProposer):
        return 0
    tp = config.parallel.tensor_parallel_size
    draft = proposer.config
    itemsize = jnp.dtype(kv_page_dtype(config.cache.kv_cache_dtype, draft.dtype)).itemsize
    heads_per_device = kv_heads_for_tp(draft, tp) // tp
    return draft.n_layers * 2 * config.cache.page_size * heads_per_device * draft.head_dim * itemsize


def _load(config: EngineConfig, options: BuildOptions, platform: str,
          pull: bool) -> tuple[LoadedModel, CheckpointWeights | GGUFWeights | DummyWeights]:
    """The model as `config.load_format` says, as shapes only, and where its weights are (the runner
    restores or makes each stage's weights on its devices): a checkpoint's (pulled first when
    `pull`: several processes pulling into one folder would race), a GGUF file's, or a preset's
    for "dummy". `config.tokenizer` replaces the model's tokenizer."""
    dummy = config.load_format == "dummy"
    if pull and not dummy:
        ensure_pulled(config.model, log=lambda message: print(message, file=sys.stderr))
    gguf_file = None if dummy or not is_gguf_file(config.model) else open_gguf_file(config.model)
    if gguf_file is not None:
        stored = gguf_file.imported.config
    else:
        stored = resolve_model_config(config.model) if dummy else read_model_config(config.model)
    dtype = run_dtype(config.dtype, stored.dtype, platform)
    if dtype != stored.dtype and config.dtype == "auto" and options.show_progress:
        print(f"orca_jax: {stored.name} is stored in {stored.dtype}; running it in {dtype} on {platform}, "
              f"where {stored.dtype} is slower (--dtype {stored.dtype} keeps it)", file=sys.stderr)
    if dummy:
        model_config = dataclasses.replace(stored, dtype=dtype)
        directory = resolve_checkpoint_dir(config.model)
        own = directory if (directory / "tokenizer.json").is_file() else None
        loaded = LoadedModel(model_config, abstract_decoder(model_config), own and Tokenizer.load(own), directory)
        print(f"orca_jax: --load-format dummy: the weights of {model_config.name} are RANDOM (seed {config.dummy_seed}); "
              "the outputs mean nothing: for trying layouts and speed", file=sys.stderr)
    elif gguf_file is not None:
        model_config = dataclasses.replace(stored, dtype=dtype)
        loaded = LoadedModel(model_config, abstract_decoder(model_config), gguf_file.imported.tokenizer, gguf_file.path)
    else:
        loaded = open_model(config.model, dtype=dtype)
    if config.tokenizer is not None:
        loaded.tokenizer = borrowed_tokenizer(config.tokenizer, loaded.config)
    if dummy:
        return loaded, DummyWeights(config.dummy_seed)
    return loaded, gguf_file or CheckpointWeights(loaded.path)


def open_gguf_file(path) -> GGUFWeights:
    """A GGUF file served as it is; a missing or unreadable file is a ConfigError saying so."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{path}: no such GGUF file; give the path of a .gguf file, a checkpoint directory or a "
                          "preset name")
    import_optional("gguf", f"serving {path}", ConfigError)
    from orca_jax.checkpoint.gguf_weights import GGUFWeights

    try:
        return GGUFWeights.open(path)
    except (OSError, ValueError, KeyError, IndexError) as error:
        # gguf's reader fails on a truncated or foreign file with whatever it tripped over; the import
        # names what it does not support (architecture, tokenizer, rope scaling) itself.
        raise ConfigError(f"cannot serve {path} as a GGUF model: {error}") from error


def stored_weights(path: Path) -> CheckpointWeights | GGUFWeights:
    """Where a loaded model's weights are: the GGUF file it was opened from, or its checkpoint."""
    return open_gguf_file(path) if is_gguf_file(path) else CheckpointWeights(path)


def model_tokenizer(name_or_path: str) -> Tokenizer:
    """The tokenizer of a model: a GGUF file's, or a checkpoint's (name or directory) tokenizer.json."""
    if is_gguf_file(name_or_path):
        tokenizer = open_gguf_file(name_or_path).imported.tokenizer
        if tokenizer is None:
            raise ConfigError(f"{name_or_path} has no vocabulary (tokenizer.ggml.tokens)")
        return tokenizer
    directory = resolve_checkpoint_dir(name_or_path)
    if not (directory / "tokenizer.json").is_file():
        raise ConfigError(f"{directory} has no tokenizer.json; give a checkpoint name or directory that has one "
                          "(e.g. smollm2-135m-instruct after `orca-jax pull`), or a .gguf file")
    return Tokenizer.load(directory)


def borrowed_tokenizer(name_or_path: str, model: ModelConfig) -> Tokenizer:
    """`--tokenizer`: the tokenizer of another model (a checkpoint's name or directory, or a .gguf
    file); its ids must all be ids of `model`'s vocabulary."""
    try:
        tokenizer = model_tokenizer(name_or_path)
    except ConfigError as error:
        raise ConfigError(f"tokenizer={name_or_path!r}: {error}") from None
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(f"tokenizer={name_or_path!r} has {tokenizer.vocab_size} tokens but {model.name} has a vocabulary "
                          f"of {model.vocab_size}: its ids would fall outside the model's; borrow a tokenizer of at "
                          f"most {model.vocab_size} tokens")
    return tokenizer


def _device_memory(devices: list | None) -> int | None:
    """The smallest memory JAX gives any of this process's accelerators (bytes_limit: on a GPU, the
    share XLA_PYTHON_CLIENT_MEM_FRACTION allows, 75% by default), or None on CPU, which reports none
    (the host's free memory then sizes the cache)."""
    local = [d for d in (devices or jax.devices()) if d.process_index == jax.process_index()]
    if local[0].platform == "cpu":
        return None
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local]
    return min(limits) if all(limits) else None


def quantized(loaded: LoadedModel, weights, quantization: str, show_progress: bool, activations: str) -> LoadedModel:
    """The loaded model with its matrices quantized (a copy: a model the caller passed in stays float),
    its parameters read from `weights` (CheckpointWeights or GGUFWeights) where it holds only their
    shapes, taking their inputs as the `activations` setting says (auto, int8 or float32)."""
    from orca_jax.model.quantization import quantize_decoder

    model, report = quantize_decoder(loaded.model, quantization, weights, activations=activations)
    if show_progress:
        print(f"orca_jax: --quantization {quantization}: {report.one_line()}", file=sys.stderr)
    return dataclasses.replace(loaded, model=model)


def run_dtype(setting: str, stored: str, platform: str) -> str:
    """The dtype a model runs in (weights, activations, KV pages). An explicit setting wins. `auto`
    is the checkpoint's own dtype, except that a 16-bit checkpoint runs in float32 on CPU: XLA:CPU
    computes bfloat16 2-8x slower than float32 (docs/numerics.md, "Dtypes"), and widening is exact, so
    it costs memory only. On a GPU `auto` keeps bfloat16, as a GPU user expects."""
    if setting != "auto":
        return setting
    return "float32" if platform == "cpu" else stored


def bucket_set(config: EngineConfig, options: BuildOptions) -> Buckets:
    limits = config.scheduler
    buckets = Buckets.for_limits(limits.max_num_batched_tokens, limits.max_num_seqs)
    if not (options.token_buckets or options.seq_buckets):
        return with_draft_rows(buckets, config)
    buckets = Buckets(tokens=tuple(sorted(options.token_buckets or buckets.tokens)),
                      seqs=tuple(sorted(options.seq_buckets or buckets.seqs)))
    if buckets.tokens[-1] != limits.max_num_batched_tokens or buckets.seqs[-1] != limits.max_num_seqs:
        raise ConfigError(
            f"the largest buckets must equal the limits: tokens {buckets.tokens} must end at "
            f"max_num_batched_tokens={limits.max_num_batched_tokens}, seqs {buckets.seqs} at "
            f"max_num_seqs={limits.max_num_seqs}")
    return with_draft_rows(buckets, config)


def with_draft_rows(buckets: Buckets, config: EngineConfig) -> Buckets:
    spec = config.speculative_config
    return buckets if spec is None else buckets.with_draft_rows(spec.num_speculative_tokens)

