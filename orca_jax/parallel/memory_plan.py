"""How a model fits a tensor x pipeline parallel layout: bytes per device and KV pages.

The plan never allocates: it builds the decoder abstractly (`abstract_decoder`, shapes only) and
reads each parameter's logical axis names. A dimension whose logical axis the rules table
(`mesh.LOGICAL_AXIS_RULES`) maps to 'tp' is divided by tp; everything else is replicated. So the
plan follows the table: change a rule and the plan changes with it. Pipeline stages are assigned
here, not by the table: stage s holds its layers, the first stage the embeddings, the last the
final norm and LM head (a tied head is the embedding matrix, so with pp > 1 both ends hold it).

Every stage gets the same number of KV pages (a sequence's page table indexes every stage's cache),
so the stage with the least room for pages sets the count for all.

The KV budget of a device, in order: `kv_cache_memory` when given; on an accelerator, what the
memory utilization x its memory leaves after the parameters; on CPU, the memory utilization x the
host's free memory after the parameters, at most HOST_KV_CEILING (4 GiB) unless one sequence of
max_model_len needs more. The builder caps a CPU budget it chose at what `max_num_seqs` sequences of
`max_model_len` need too (host memory the engine can never use is left to the host). When
`max_model_len` is not given and the budget cannot hold one sequence of the model's context,
max_model_len is lowered to the pages it can hold; a given one that does not fit is refused.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx

from orca_jax.config import CacheConfig, ConfigError, DType, ModelConfig, ParallelConfig, kv_page_dtype
from orca_jax.model.decoder import abstract_decoder
from orca_jax.parallel import mesh
from orca_jax.parallel.layout import check_parallel, kv_heads_for_tp, stage_layer_ranges
from orca_jax.sizes import format_bytes

# The most KV a CPU budget takes from the host's free memory on its own (kv_cache_memory not given),
# unless one sequence of max_model_len needs more: what a few long sequences or many short ones use.
HOST_KV_CEILING = 4 << 30

# Device memory kept back for everything besides parameters and KV: one step's activations
# ([T, D] buffers, the MLP's [T, F/tp], [S, V/tp] f32 logits: tens of MB even for 175B at 512
# tokens), XLA's scratch and compiled programs, and allocator fragmentation. The reserve is what the
# utilization F leaves, (1 - F) x memory; F's default is the setting's (device_memory_utilization,
# 0.9 as vLLM's gpu_memory_utilization), declared once in config.py.
DEFAULT_MEMORY_UTILIZATION = CacheConfig().device_memory_utilization

FIX = "use more devices (larger tensor_parallel_size or pipeline_parallel_size)"


@dataclass(frozen=True)
class StagePlan:
    layers: range
    param_bytes: int  # on each of the stage's tp devices
    # on each device: stage layers x (K, V) x page_size x local KV heads x head_dim x itemsize, plus on the
    # last stage a draft model's pages
    kv_bytes_per_page: int


@dataclass(frozen=True)
class MemoryPlan:
    """Per-device figures of a layout; a "device" figure is the largest over the stages."""

    model_name: str
    dtype: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    kv_heads: int  # KV heads of the runtime model (replicated up to tp when tp exceeds them)
    page_size: int  # tokens per KV page
    max_model_len: int  # tokens per sequence (prompt + generated)
    stages: tuple[StagePlan, ...]
    device_memory: int | None  # bytes per device, None when only the KV budget was given
    reserve_bytes: int  # per device, kept for activations and workspace (0 without device_memory)
    num_pages: int  # KV pages, the same on every device
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION  # of device_memory, parameters + KV
    host_memory: int | None = None  # the host's free memory the KV budget came from (CPU), else None
    capped_at_seqs: int | None = None  # max_num_seqs, when the budget was capped at its sequences (CPU)
    lowered_from: int | None = None  # the model's context length, when max_model_len was lowered to fit
    kv_ceiling: int | None = None  # bytes, when HOST_KV_CEILING (or one sequence) bounded a CPU budget

    @property
    def param_bytes(self) -> int:
        return max(s.param_bytes for s in self.stages)

    @property
    def kv_bytes_per_page(self) -> int:
        return max(s.kv_bytes_per_page for s in self.stages)

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.kv_bytes_per_page

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_full_sequences(self) -> int:
        """Sequences of max_model_len tokens the cache holds at once (each takes whole pages)."""
        return self.num_pages // math.ceil(self.max_model_len / self.page_size)

    def _layout(self) -> str:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        return f"tp {tp} x pp {pp} = {tp * pp} device{'s' if tp * pp > 1 else ''}"

    def _kv_source(self) -> str:
        """Where the KV budget came from, for the summaries ("" when kv_cache_memory gave it)."""
        return _budget_source(self.memory_utilization, self.device_memory, self.host_memory,
                              self.tensor_parallel_size * self.pipeline_parallel_size)

    def _cap(self) -> str:
        if self.kv_ceiling is not None:
            return f", capped at {format_bytes(self.kv_ceiling)} (--kv-cache-memory takes more)"
        return "" if self.capped_at_seqs is None else f", capped at max_num_seqs={self.capped_at_seqs}"

    def lowered_note(self) -> str | None:
        """The line saying max_model_len was lowered to fit the KV cache, None when it was not."""
        if self.lowered_from is None:
            return None
        source = f" from {self._kv_source()}" if self._kv_source() else ""
        return (f"max_model_len lowered from {self.model_name}'s context length {self.lowered_from} to "
                f"{self.max_model_len} tokens, all the KV cache holds ({format_bytes(self.kv_bytes)} per device"
                f"{source}); more memory for the KV cache gives a longer one")

    def summary(self) -> str:
        memory = "" if self.device_memory is None else f", {format_bytes(self.device_memory)} each"
        stages = ", ".join(f"{s.layers.start}-{s.layers.stop - 1}" for s in self.stages)
        lines = [
            f"{self.model_name} ({self.dtype}) on {self._layout()}{memory}",
            f"  layers per stage: {stages}; KV heads {self.kv_heads} "
            f"({self.kv_heads // self.tensor_parallel_size} per device)",
            f"  per device: parameters {format_bytes(self.param_bytes)}, KV cache {format_bytes(self.kv_bytes)}"
            + ("" if self.device_memory is None else
               f", reserve {format_bytes(self.reserve_bytes)} ({1 - self.memory_utilization:.0%}) for activations and "
               "workspace"),
            f"  KV: {self.num_pages} pages x {self.page_size} tokens ({format_bytes(self.kv_bytes_per_page)} each) = "
            f"{self.num_tokens} tokens = {self.num_full_sequences} sequences of {self.max_model_len} tokens"
            f"{self._cap()}",
        ]
        if self.host_memory is not None:
            lines.append(f"  KV budget: {self._kv_source()}")
        if self.lowered_from is not None:
            lines.append(f"  {self.lowered_note()}")
        return "\n".join(lines)

    def one_line(self) -> str:
        memory = f" of {self._kv_source()}" if self._kv_source() else ""
        return (
            f"memory plan: {self.model_name} {self.dtype} {self._layout()}{memory}: "
            f"parameters {format_bytes(self.param_bytes)}/device, KV {self.num_pages} pages x {self.page_size} = "
            f"{self.num_tokens} tokens ({format_bytes(self.kv_bytes)}/device, "
            f"{self.num_full_sequences} x {self.max_model_len}-token sequences{self._cap()})"
        )


def param_shapes(model: ModelConfig) -> list[tuple[tuple, tuple[int, ...], tuple, int]]:
    """(path, shape, logical axes, itemsize) of every parameter, by abstract evaluation.

    Evaluates a one-layer decoder and repeats its layer for every index: the Decoder's layers are
    identical by construction, and tracing them all is quadratic in jax 0.10.2 (each RNG draw makes
    flax probe a tracer's `.sharding`, and jax walks the whole trace to word an error it never
    raises): 96 layers take 5-15 s, one layer well under one. A test checks the shortcut against
    the full evaluation.
    """
    # Layers of one model have the same parameters whatever their kind (sliding or full attention).
    one_layer = abstract_decoder(dataclasses.replace(model, n_layers=1, layer_types=model.layer_types and model.layer_types[:1]))
    records = _flat_params(one_layer)
    shapes = [r for r in records if r[0][0] != "layers"]
    for i in range(model.n_layers):
        shapes += [(("layers", i) + path[2:], *rest) for path, *rest in records if path[0] == "layers"]
    return shapes


def _flat_params(decoder) -> list[tuple[tuple, tuple[int, ...], tuple, int]]:
    state = nnx.state(decoder, nnx.Param)
    axes = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    return [
        (path, tuple(value.get_value().shape), tuple(axes[path].get_value()), value.get_value().dtype.itemsize)
        for path, value in nnx.to_flat_state(state)
    ]


def _splits_over_tp(logical_axis: str | None) -> bool:
    if logical_axis is None:
        return False
    if logical_axis not in mesh.LOGICAL_AXIS_RULES:
        raise ValueError(f"logical axis {logical_axis!r} has no entry in LOGICAL_AXIS_RULES")
    mesh_axes = mesh.LOGICAL_AXIS_RULES[logical_axis]
    return mesh_axes == "tp" or (isinstance(mesh_axes, tuple) and "tp" in mesh_axes)


def _bytes_per_device(shape: tuple[int, ...], axes: tuple, itemsize: int, tp: int) -> int:
    return math.prod(-(-dim // tp) if _splits_over_tp(axis) else dim for dim, axis in zip(shape, axes)) * itemsize


def _stages_holding(path: tuple, ranges: list[range], tied: bool) -> list[int]:
    last = len(ranges) - 1
    top = path[0]
    if top == "layers":
        return [next(s for s, r in enumerate(ranges) if path[1] in r)]
    if top == "embed":
        return sorted({0, last}) if tied else [0]
    if top == "pos_embed":
        return [0]
    if top in ("final_norm", "lm_head"):
        return [last]
    # A new top-level parameter must be placed on purpose, never silently left out of the plan.
    raise ValueError(f"the memory plan does not know which pipeline stage holds parameter {path}")


def plan_memory(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    page_size: int,
    max_model_len: int | None = None,
    device_memory: int | None = None,
    kv_cache_memory: int | None = None,
    host_memory: int | None = None,
    max_num_seqs: int | None = None,
    dtype: DType | None = None,
    kv_cache_dtype: str = "auto",
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
    loaded_model=None,
    draft_kv_bytes_per_page: int = 0,
) -> MemoryPlan:
    """Plans parameters and KV pages per device, or raises ConfigError naming the shortfall and fix.

    `device_memory`: bytes the engine may use on each device (note JAX preallocates 75% of a GPU by
    default: pass that figure, or raise XLA_PYTHON_CLIENT_MEM_FRACTION). `kv_cache_memory`: KV bytes
    per device; without it the KV cache takes what parameters and the reserve leave. `host_memory`
    (CPU, when neither is given): the host's free memory, which the layout's devices share; a
    device's KV cache gets `memory_utilization` x (its share - its parameters). `max_num_seqs`: when
    given, the pages are capped at what that many sequences of max_model_len take (on CPU, where
    memory the engine can never use is better left to the host). `max_model_len` defaults to the
    model's context length, lowered to the pages the cache holds when it holds less (`lowered_from`
    says so); a given one that does not fit is refused. `dtype` overrides the model's; `kv_cache_dtype` is the
    KV pages' ("auto": the model's). `memory_utilization` (vLLM's gpu_memory_utilization): the
    fraction of `device_memory` for parameters and KV; the rest is the reserve. `loaded_model`: the
    Decoder as it will be placed, when its arrays differ from what `model`'s dtype implies
    (quantized matrices: their own bytes count, not float ones). `draft_kv_bytes_per_page`: a draft
    model's KV bytes per page on each device of the last stage, which holds the draft's pages
    beside the target's, as many.
    """
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if dtype is not None:
        model = dataclasses.replace(model, dtype=dtype)
    check_parallel(model, parallel)
    if page_size < 1 or (max_model_len is not None and max_model_len < 1):
        raise ConfigError(f"page_size and max_model_len must be positive, got {page_size} and {max_model_len}")
    if max_model_len is not None and max_model_len > model.max_position:
        raise ConfigError(f"max_model_len={max_model_len} exceeds {model.name!r}'s context length {model.max_position}")
    if device_memory is None and kv_cache_memory is None and host_memory is None:
        raise ConfigError("give device_memory (bytes per device), kv_cache_memory (KV bytes per device) or "
                          "host_memory (the host's free memory, on CPU)")
    if not 0 < memory_utilization <= 1:
        raise ConfigError(f"memory utilization {memory_utilization} must be in (0, 1], e.g. 0.9")
    from_host = kv_cache_memory is None and device_memory is None
    kv_ceiling = None

    # The runtime model: KV heads replicated up to tp (the K/V projections then have tp heads).
    kv_heads = kv_heads_for_tp(model, tp)
    runtime = dataclasses.replace(model, n_kv_heads=kv_heads)
    ranges = stage_layer_ranges(model.n_layers, pp)
    param_bytes = [0] * pp
    shapes = param_shapes(runtime) if loaded_model is None else _flat_params(loaded_model)
    for path, shape, axes, itemsize in shapes:
        for stage in _stages_holding(path, ranges, model.tie_word_embeddings):
            param_bytes[stage] += _bytes_per_device(shape, axes, itemsize, tp)
    itemsize = jnp.dtype(kv_page_dtype(kv_cache_dtype, model.dtype)).itemsize
    stages = tuple(
        StagePlan(r, param_bytes[s], len(r) * 2 * page_size * (kv_heads // tp) * model.head_dim * itemsize
                  + (draft_kv_bytes_per_page if s == pp - 1 else 0))
        for s, r in enumerate(ranges)
    )
    largest = max(stages, key=lambda s: s.param_bytes)

    reserve = 0
    if device_memory is not None:
        reserve = device_memory - int(device_memory * memory_utilization)
        if largest.param_bytes + reserve > device_memory:
            short = largest.param_bytes + reserve - device_memory
            raise ConfigError(
                f"{model.name} ({model.dtype}) does not fit tp {tp} x pp {pp} on {format_bytes(device_memory)} "
                f"devices at memory utilization {memory_utilization:g}: parameters need "
                f"{format_bytes(largest.param_bytes)} per device plus a {format_bytes(reserve)} reserve, short by "
                f"{format_bytes(short)} per device; {FIX}, or raise the memory utilization"
            )

    # KV budget of each stage; a stage's budget / its page size bounds the shared page count.
    if kv_cache_memory is not None:
        budgets = [kv_cache_memory] * pp
    elif device_memory is not None:
        budgets = [device_memory - reserve - s.param_bytes for s in stages]
    else:
        # On CPU the parameters come out of the host's free memory first; the utilization's share of
        # the rest is the KV cache's, and what it leaves is the host's (activations, compiled
        # programs, other processes), as the reserve is on an accelerator.
        share = host_memory // (tp * pp)
        if largest.param_bytes > share:
            raise ConfigError(
                f"{model.name} ({model.dtype}) does not fit this host's free memory on tp {tp} x pp {pp}: parameters "
                f"need {format_bytes(largest.param_bytes)} per device, and {format_bytes(host_memory)} free shared by "
                f"{tp * pp} device(s) leaves {format_bytes(share)} each, short by "
                f"{format_bytes(largest.param_bytes - share)}; free memory on the host, or run a smaller dtype or "
                "a quantized model"
            )
        budgets = [int((share - s.param_bytes) * memory_utilization) for s in stages]
        # Nor more than HOST_KV_CEILING unless one sequence of the context needs more: a 135M model
        # would otherwise zero-fill most of the machine at every start for sequences no one sends.
        one_sequence = math.ceil((max_model_len or model.max_position) / page_size)
        ceilings = [max(HOST_KV_CEILING, one_sequence * s.kv_bytes_per_page) for s in stages]
        kv_ceiling = max(ceilings) if any(b > c for b, c in zip(budgets, ceilings)) else None
        budgets = [min(b, c) for b, c in zip(budgets, ceilings)]
    if kv_cache_memory is not None and device_memory is not None:
        over = largest.param_bytes + reserve + kv_cache_memory - device_memory
        if over > 0:
            raise ConfigError(
                f"kv_cache_memory={format_bytes(kv_cache_memory)} per device does not fit beside "
                f"{format_bytes(largest.param_bytes)} of parameters and a {format_bytes(reserve)} reserve in "
                f"{format_bytes(device_memory)}: short by {format_bytes(over)} per device; lower kv_cache_memory "
                f"to {format_bytes(kv_cache_memory - over)} or {FIX}"
            )
    # The runner adds one scratch page (padding writes) beyond these, which the reserve covers.
    num_pages = min(budget // s.kv_bytes_per_page for budget, s in zip(budgets, stages))

    # Not given, max_model_len is the model's context, or the whole pages the cache holds when that
    # is less: a model trained for 128K tokens still starts where its full context does not fit.
    lowered_from = None
    if max_model_len is None:
        max_model_len = model.max_position
        if 0 < num_pages < math.ceil(max_model_len / page_size):
            lowered_from, max_model_len = max_model_len, num_pages * page_size

    source = (_budget_source(memory_utilization, device_memory, host_memory if from_host else None, tp * pp)
              or f"kv_cache_memory={format_bytes(kv_cache_memory)}")
    pages_per_sequence = math.ceil(max_model_len / page_size)
    if num_pages < pages_per_sequence:
        short = max(pages_per_sequence * s.kv_bytes_per_page - budget for budget, s in zip(budgets, stages))
        lower = f"Lower max_model_len to {num_pages * page_size} or less" if num_pages else "Lower max_model_len"
        raise ConfigError(
            f"{model.name} on tp {tp} x pp {pp}: the KV cache holds {num_pages * page_size} tokens per device "
            f"({source}), less than one sequence of max_model_len={max_model_len}; short by {format_bytes(short)} "
            f"per device. {lower}, or give the KV cache more memory {_more_kv_memory(kv_cache_memory, from_host)}"
        )

    # At most max_num_seqs sequences of max_model_len are in the cache at once.
    capped_at_seqs = None
    if max_num_seqs is not None and num_pages > max_num_seqs * pages_per_sequence:
        num_pages, capped_at_seqs = max_num_seqs * pages_per_sequence, max_num_seqs
    return MemoryPlan(
        model_name=model.name, dtype=model.dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        kv_heads=kv_heads, page_size=page_size, max_model_len=max_model_len, stages=stages,
        device_memory=device_memory, reserve_bytes=reserve, num_pages=num_pages, memory_utilization=memory_utilization,
        host_memory=host_memory if from_host else None, capped_at_seqs=capped_at_seqs, lowered_from=lowered_from,
        kv_ceiling=None if capped_at_seqs is not None else kv_ceiling,
    )


def _budget_source(utilization: float, device_memory: int | None, host_memory: int | None, devices: int) -> str:
    """Where a KV budget the plan derived came from; "" when kv_cache_memory gave it."""
    if host_memory is not None:
        share = "" if devices == 1 else f" / {devices} devices"
        return f"{utilization:g} x ({format_bytes(host_memory)} free host memory{share} - parameters)"
    if device_memory is not None:
        return f"{utilization:g} x {format_bytes(device_memory)} per device"
    return ""


def _more_kv_memory(kv_cache_memory: int | None, from_host: bool) -> str:
    """How to give the KV cache more memory, for a budget from each source."""
    if kv_cache_memory is not None:
        return f"(raise kv_cache_memory), or {FIX}"
    if from_host:  # more CPU devices share the same host: they add no memory
        return "(free memory on the host, raise the memory utilization or give kv_cache_memory)"
    return f"(raise the memory utilization), or {FIX}"
