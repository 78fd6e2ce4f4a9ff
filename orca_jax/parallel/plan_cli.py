"""`orca-jax plan`: does a model fit a tp x pp layout, and how many KV pages does it get?

Importing this module does not import jax (cli.py builds every subcommand's parser at start-up);
`plan_command` imports the planner when it runs.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from orca_jax.config import (DEFAULT_CPU_KV_CACHE_MEMORY, DEFAULT_MODEL, CacheConfig, ConfigError, DType,
                             ModelConfig, ParallelConfig, SchedulerConfig, load_toml)
from orca_jax.config import load_model_preset, model_preset_names
from orca_jax.paths import is_gguf_file
from orca_jax.sizes import byte_size


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"preset name, checkpoint directory with a model.toml, or .gguf file (planned as "
                             f"served: its own blocks) (default {DEFAULT_MODEL})")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="devices each layer is split over")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, help="stages the layers are split into")
    parser.add_argument("--device-memory", type=byte_size,
                        help="memory of each device, e.g. 40GiB; the KV cache gets what parameters and the reserve "
                             "leave. Without it or --kv-cache-memory: this host's free memory, as the engine on CPU")
    parser.add_argument("--kv-cache-memory", type=byte_size, help="KV cache bytes per device, e.g. 4GiB")
    utilization = CacheConfig().device_memory_utilization
    parser.add_argument("--gpu-memory-utilization", type=float, default=utilization, dest="memory_utilization",
                        help=f"fraction of --device-memory for parameters and KV (default {utilization:g}); the rest "
                             "is the reserve. On CPU: of the host's free memory after the parameters, for KV")
    max_num_seqs = SchedulerConfig().max_num_seqs
    parser.add_argument("--max-num-seqs", type=int, default=max_num_seqs,
                        help=f"requests running at once (default {max_num_seqs}): without --device-memory or "
                             "--kv-cache-memory the KV cache holds at most this many sequences of max_model_len")
    parser.add_argument("--page-size", type=int, default=CacheConfig().page_size, help="tokens per KV page")
    parser.add_argument("--max-model-len", type=int, help="tokens per sequence (default: the model's context length)")
    parser.add_argument("--dtype", choices=typing.get_args(DType), help="override the model's parameter dtype")


def resolve_model_config(name_or_path: str) -> ModelConfig:
    """A GGUF file's config, a directory's model.toml, else a preset, else a converted checkpoint of
    that name."""
    path = Path(name_or_path)
    if is_gguf_file(name_or_path):
        from orca_jax.runner.builder import open_gguf_file

        return open_gguf_file(path).imported.config
    if path.is_dir():
        if not (path / "model.toml").is_file():
            raise ConfigError(f"{path} has no model.toml; pass a checkpoint directory or a preset name")
        return load_toml(ModelConfig, path / "model.toml")
    if name_or_path in model_preset_names():
        return load_model_preset(name_or_path)
    from orca_jax.checkpoint.store import resolve_checkpoint_dir

    stored = resolve_checkpoint_dir(name_or_path) / "model.toml"
    if stored.is_file():
        return load_toml(ModelConfig, stored)
    raise ConfigError(
        f"no model {name_or_path!r}: pass a checkpoint directory with a model.toml or a preset "
        f"({', '.join(model_preset_names())})"
    )


def plan_command(args: argparse.Namespace) -> int:
    """Prints the plan and returns 0, or prints `error: ...` to stderr and returns 2."""
    from orca_jax.host_memory import available_host_memory
    from orca_jax.parallel.memory_plan import plan_memory

    try:
        parallel = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                  pipeline_parallel_size=args.pipeline_parallel_size)
        kv_cache_memory, host_memory, max_num_seqs = args.kv_cache_memory, None, None
        if args.device_memory is None and kv_cache_memory is None:
            # As the engine on CPU sizes its cache (runner/builder.py): from this host's free memory
            # (the fixed default where it is unknown), at most what max_num_seqs sequences take.
            host_memory, max_num_seqs = available_host_memory(), args.max_num_seqs
            if host_memory is None:
                kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY
        model, served = _gguf_as_served(args.model, args.dtype) if is_gguf_file(args.model) else (
            resolve_model_config(args.model), None)
        plan = plan_memory(
            model, parallel, page_size=args.page_size, max_model_len=args.max_model_len,
            device_memory=args.device_memory, kv_cache_memory=kv_cache_memory, host_memory=host_memory,
            max_num_seqs=max_num_seqs, dtype=args.dtype, memory_utilization=args.memory_utilization,
            loaded_model=served,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plan.summary())
    return 0


def _gguf_as_served(path: str, dtype: str | None):
    """A GGUF file's config and its decoder as the engine serves it by default (`--quantization gguf`:
    the file's block types, each at its own size), shapes only: nothing of the tensors is read."""
    import dataclasses

    from orca_jax.model.decoder import abstract_decoder
    from orca_jax.model.quantization import abstract_gguf_decoder
    from orca_jax.runner.builder import open_gguf_file

    weights = open_gguf_file(path)
    config = weights.imported.config if dtype is None else dataclasses.replace(weights.imported.config, dtype=dtype)
    return config, abstract_gguf_decoder(abstract_decoder(config), weights.reader, weights.path)
