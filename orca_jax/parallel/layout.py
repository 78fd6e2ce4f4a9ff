"""TEMPORARY stand-in; replaced by the memory-plan branch."""
from orca_jax.config import ConfigError, ModelConfig, ParallelConfig


def stage_layer_ranges(n_layers: int, pp: int) -> list[range]:
    if pp > n_layers:
        raise ConfigError(f"pipeline_parallel_size={pp} exceeds the model's {n_layers} layers")
    base, extra = divmod(n_layers, pp)
    ranges, start = [], 0
    for i in range(pp):
        size = base + (i < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def kv_heads_for_tp(model: ModelConfig, tp: int) -> int:
    return model.n_kv_heads if model.n_kv_heads % tp == 0 else tp


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    def ok(t):
        return (model.n_heads % t == 0 and model.d_ff % t == 0 and model.vocab_size % t == 0
                and (model.n_kv_heads % t == 0 or t % model.n_kv_heads == 0))
    if not ok(tp):
        good = [t for t in range(1, model.n_heads + 1) if ok(t)]
        raise ConfigError(f"tensor_parallel_size={tp} does not divide {model.name}; sizes that work: {good}")


def check_parallel(model: ModelConfig, parallel: ParallelConfig, num_devices: int | None = None) -> None:
    check_tensor_parallel(model, parallel.tensor_parallel_size)
    stage_layer_ranges(model.n_layers, parallel.pipeline_parallel_size)
    needed = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    if num_devices is not None and needed > num_devices:
        raise ConfigError(f"needs {needed} devices, {num_devices} visible")


def kv_bytes_per_page(model: ModelConfig, parallel: ParallelConfig, page_size: int) -> int:
    itemsize = 2 if model.dtype in ("bfloat16", "float16") else 4
    tp = parallel.tensor_parallel_size
    layers = max(len(r) for r in stage_layer_ranges(model.n_layers, parallel.pipeline_parallel_size))
    return layers * 2 * page_size * (kv_heads_for_tp(model, tp) // tp) * model.head_dim * itemsize
