"""Which parallel layouts a model allows: pipeline stages and tensor-parallel divisibility.

Pure Python (no jax), so the CLI and config validation can refuse a layout before any device starts.
Tensor parallelism (Megatron style) splits query heads, KV heads, the MLP width and the vocabulary
over `tp` devices; pipeline parallelism gives each of `pp` stages a contiguous run of layers.
"""

from __future__ import annotations

from orca_jax.config import ConfigError, ModelConfig, ParallelConfig


def stage_layer_ranges(n_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges, one per stage; sizes differ by at most one and the earlier stages
    take the extra layers (they also hold the embedding, but the last holds the larger LM head)."""
    if pp < 1:
        raise ConfigError(f"pipeline_parallel_size must be a positive integer, got {pp}")
    if pp > n_layers:
        raise ConfigError(
            f"pipeline_parallel_size={pp} exceeds the model's {n_layers} layers; every stage needs at least "
            f"one layer, so use pipeline_parallel_size <= {n_layers}"
        )
    base, extra = divmod(n_layers, pp)
    ranges, start = [], 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def _kv_heads_fit(n_kv_heads: int, tp: int) -> bool:
    # Split when tp divides the KV heads; replicate when tp is a multiple of them (each device
    # then holds one copy of the KV head its query heads read).
    return n_kv_heads % tp == 0 or tp % n_kv_heads == 0


def _tp_failures(model: ModelConfig, tp: int) -> list[str]:
    failures = [
        f"{name}={value} is not divisible by {tp}"
        for name, value in (("n_heads", model.n_heads), ("d_ff", model.d_ff), ("vocab_size", model.vocab_size))
        if value % tp
    ]
    if not _kv_heads_fit(model.n_kv_heads, tp):
        failures.append(f"n_kv_heads={model.n_kv_heads} is neither divisible by {tp} nor a divisor of it")
    return failures


def working_tp_sizes(model: ModelConfig) -> list[int]:
    """Every tensor-parallel size this model allows (tp must divide n_heads, so none exceeds it)."""
    return [t for t in range(1, model.n_heads + 1) if not _tp_failures(model, t)]


def _or_list(values: list[int]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """Raises ConfigError naming what `tp` fails to divide and the sizes that do work."""
    if tp < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp}")
    failures = _tp_failures(model, tp)
    if failures:
        raise ConfigError(
            f"model {model.name!r} cannot be split over tensor_parallel_size={tp}: {'; '.join(failures)}. "
            f"This model runs at tp {_or_list(working_tp_sizes(model))}"
        )


def kv_heads_for_tp(model: ModelConfig, tp: int) -> int:
    """KV heads of the runtime model: n_kv_heads when tp divides them, else tp (each KV head is
    repeated tp // n_kv_heads times, tiled once at load, so every device holds exactly one)."""
    check_tensor_parallel(model, tp)
    return model.n_kv_heads if model.n_kv_heads % tp == 0 else tp


def check_parallel(model: ModelConfig, parallel: ParallelConfig, num_devices: int | None = None) -> None:
    """All layout checks; `num_devices` (the visible devices) is skipped when None (planning)."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    check_tensor_parallel(model, tp)
    stage_layer_ranges(model.n_layers, pp)
    if num_devices is not None and tp * pp > num_devices:
        raise ConfigError(
            f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} needs {tp * pp} devices, but "
            f"{num_devices} are visible; lower tensor_parallel_size or pipeline_parallel_size, or to test on "
            f"CPU set JAX_NUM_CPU_DEVICES={tp * pp} before starting"
        )
