"""The model runner: the only owner of jit, buckets, devices, meshes, parameters and KV arrays.

The model is split into `pipeline_parallel_size` stages of contiguous layers. Each `Stage` has its
own mesh of `tensor_parallel_size` devices, its own parameters and KV arrays (sharded over 'tp' by
the logical-axis rules) and its own jitted program; with one stage it is the whole model on one
mesh. A step (`run_plan`) places the plan's arrays on every stage, runs the stages in order and
moves the activations [T, D] from one stage's mesh to the next with `jax.device_put`. Nothing
waits: jax dispatches asynchronously, so while stage 1 computes step n, stage 0 can already run
step n + 1 (the engine keeps up to `max_in_flight` = pp steps dispatched). `collect` copies back
the step's one small result (sampled tokens). A step's many small host arrays (token ids, slots,
block tables, sampling parameters) travel as one buffer per dtype (packing.py), and the programs
take the parameters as leaves flattened once: at one sequence, host work per step was otherwise as
long as several layers. With one stage the head also returns its sampled tokens padded to [R_max]
(`Stage.fed_tokens`), and the next step's layers take a plan's `token_source` tokens from them:
async scheduling plans a step before the tokens it continues are back on the host.

Across processes (parallel/multihost.py) a stage lives on one process; each process builds only the
stages it owns, the leader sends every plan to the followers before running it, and every process
runs every plan: its own stages, and its side of each transfer between processes (a process that
does not hold a stage's output passes a placeholder with the output's shape and no local data).

Compiled shapes: a stage's layers are one program per token bucket only (the attention inputs
always carry `max_num_seqs` rows of block tables), and the last stage's final norm, LM head and
sampler one small program per sequence bucket; so a start-up compiles |token buckets| +
|sequence buckets| programs, not their product. Warm-up compiles every one ahead of time
(`lower(...).compile()`, no padding steps run), loading each from the executable store
(compile_cache.py) when an earlier run of the same code and settings stored it. A step calls the
compiled programs directly; a shape that was not compiled at warm-up is compiled on the spot and
counted in `num_compilations_after_warmup` (it must stay 0: a compile in serving is a multi-second
stall).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Int
from tqdm.auto import tqdm

from orca_jax.config import ConfigError, EngineConfig, kv_page_dtype, matmul_precision_for
from orca_jax.runner.compile_cache import ExecutableStore, enable_compilation_cache
from orca_jax.runner.packing import pack
from orca_jax.engine.step_plan import Buckets, KVLayout, RunnerLost, StepPlan, StepTokens, padding_plan, step_tokens
from orca_jax.model.attention import AttentionMetadata
from orca_jax.model.decoder import Decoder, DecoderStage
from orca_jax.model.linear import linear_methods
from orca_jax.model.backends import Backends
from orca_jax.model.sampler import SamplerOutput, SamplingMetadata, sample
from orca_jax.sampling_params import MAX_LOGPROBS
from orca_jax.parallel import kv_cache_sharding, param_shardings, stage_meshes
from orca_jax.parallel.layout import check_parallel, kv_heads_for_tp, stage_layer_ranges
from orca_jax.parallel.tensor_parallel import kv_projections_replicated, replicate_kv_heads, sharded_paged_attention
from orca_jax.runner.draft_model import DraftModelRunner
from orca_jax.runner.float_rows import float_rows_methods, float_rows_stage
from orca_jax.runner.speculation import (DraftModelProposer, NgramProposer, SpeculationMetadata, SpeculativeOutput,
                                         verify_and_propose, write_tokens)

log = logging.getLogger(__name__)



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """A StepPlan's token arrays as the layers' programs take them: one pytree, packed (packing.py)
    and placed on a stage's devices by the program's call (see step_plan.StepPlan for the fields'
    meaning)."""

    token_ids: Int[Array, " T"]
    token_source: Int[Array, " T"]  # -1, or the previous step's logit row whose sampled token it is
    attention: AttentionMetadata  # positions, segment ids, slots; block tables and KV lengths [S_max]
    logits_index: Int[Array, " R_max"]

    @classmethod
    def of(cls, plan: StepPlan) -> "StepInputs":
        attention = AttentionMetadata(positions=plan.positions, segment_ids=plan.segment_ids,
                                      slot_mapping=plan.slot_mapping, block_tables=plan.block_tables,
                                      kv_lens=plan.kv_lens,
                                      # Static batches' finished members are computed, as FasterTransformer's.
                                      num_tokens=np.int32(plan.num_real_tokens + plan.num_padding_seqs))
        return cls(token_ids=plan.token_ids, token_source=plan.token_source, attention=attention,
                   logits_index=plan.logits_index)


@dataclasses.dataclass
class RunnerStats:
    """Cumulative figures since start (or the last `reset`), for benchmarks and metrics."""

    steps: int = 0
    device_s: float = 0.0  # dispatch + waiting for the result (device compute that overlaps host work is free)
    real_tokens: int = 0
    padded_tokens: int = 0  # tokens computed including bucket padding
    buckets: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # steps per (T, S)
    first_runs: int = 0  # steps that ran a program for the first time (slow: see ModelRunner.run_first_runs)


@dataclasses.dataclass
class Stage:
    """One pipeline stage: a contiguous run of layers on its own mesh of tp devices."""

    index: int
    layers: range
    mesh: Mesh
    replicated: NamedSharding  # step inputs and activations: whole on every device of the stage
    first: bool
    last: bool
    local: bool  # this process owns the stage's devices; otherwise the three fields below are empty
    params: Any = None  # nnx.State of the stage's DecoderStage, sharded by the logical-axis rules
    # `params` flattened once: the programs take the leaves, so a step does not flatten the
    # State's ~270 variables at every call (~1.5 ms of host time per step)
    param_leaves: list = dataclasses.field(default_factory=list)
    kv_caches: list = dataclasses.field(default_factory=list)  # one (k_pages, v_pages) per layer
    # A speculating runner's last stage: the token id of every KV slot [P + 1, page] (speculation.py)
    token_pages: Any = None
    # The only stage's latest sampled tokens [R_max] (int32, one per logit row), which the next
    # step's tokens may take (StepPlan.token_source: async scheduling); None with several stages
    fed_tokens: Any = None
    # jitted (params, kv_caches, token_pages, x, inputs, fed_tokens) -> (activations [T, D], or from
    # the last stage those of each logit row's token [R_max, D]; kv_caches; token_pages)
    layers_program: Callable | None = None
    # Each matrix's linear method (model/linear.py), part of every program's cache key: two layouts
    # can hold arrays of one shape (Q5_0 and Q5_K rows are both 22 bytes per 32 weights)
    linear_methods: str = ""
    # the last stage's jitted (params, logit-row activations [R_max, D], sampling [R], speculation,
    # token_pages) -> (SamplerOutput, or SpeculativeOutput when speculating; the sampled tokens
    # padded to [R_max], the next fed_tokens)
    head_program: Callable | None = None
    # ("layers", T) or ("head", R) -> the compiled program, filled by warm-up
    executables: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Pending:
    """A dispatched step: its plan and the device arrays of its result (not yet copied back)."""

    plan: StepPlan
    result: SamplerOutput | SpeculativeOutput


class ModelRunner:
    def __init__(
        self,
        model: Decoder,
        settings: EngineConfig,
        *,
        num_pages: int,
        max_model_len: int,
        buckets: Buckets,
        devices: list | None = None,
        step_timeout: float | None = None,
        executable_store: ExecutableStore | None = None,
        proposer: NgramProposer | DraftModelProposer | None = None,
        weights=None,
    ):
        """`settings`: the engine settings the runner reads: the KV pages' size and dtype (`cache`;
        "auto": the model's dtype), the layout (`parallel`: `devices`, default all of jax.devices(),
        every process's, are split into pp x tp), `attention_impl` and `matmul_impl` (resolved here
        for the devices' platform; "native" turns each stage's float matrices into rows for the native
        kernel once they are on their devices), `matmul_precision` (config.matmul_precision_for:
        "auto" is full precision for float32 models) and `quantization` (how the model's matrices were
        quantized: it already holds them so; for the layout settings and the start-up line). The
        builder makes the rest from them: `num_pages`, `max_model_len` and `buckets`.
        `step_timeout`: seconds to wait for a step's result from other processes before raising
        RunnerLost (multi-host only; warm-up allows ten times as long). Compiled programs are kept in
        `executable_store` (default: under $ORCA_JAX_COMPILATION_CACHE).
        `proposer`: speculative decoding's n-gram drafts (speculation.py) or draft model (draft_model.py,
        run on the last stage's devices); `buckets` then need logit-row buckets (`with_draft_rows`).
        `weights` (a CheckpointWeights or DummyWeights): the model is abstract (shapes only) and each
        stage's parameters come from it, straight into their shardings; None: the model's own arrays
        are placed."""
        enable_compilation_cache()
        config = model.config
        parallel, page_size = settings.parallel, settings.cache.page_size
        check_parallel(config, parallel)
        meshes = stage_meshes(parallel, devices)
        self.config = config
        self.parallel = parallel
        self.proposer = proposer
        num_drafts = proposer.num_speculative_tokens if proposer else 0
        if proposer and buckets.row_buckets[-1] < buckets.seqs[-1] * (1 + num_drafts):
            raise ConfigError(f"speculating with {num_drafts} drafts needs logit-row buckets up to "
                              f"{buckets.seqs[-1] * (1 + num_drafts)}; build them with Buckets.with_draft_rows")
        self.kv_layout = KVLayout(num_pages, page_size, -(-max_model_len // page_size), buckets.seqs[-1], num_drafts)
        self.executable_store = executable_store or ExecutableStore.default()
        self.kv_dtype = jnp.dtype(kv_page_dtype(settings.cache.kv_cache_dtype, config.dtype))
        self.matmul_precision = matmul_precision_for(settings.matmul_precision, config.dtype)
        self.weights = weights
        self.quantization = settings.quantization
        self.buckets = buckets
        self.max_in_flight = parallel.pipeline_parallel_size
        platform = meshes[0].devices.flat[0].platform
        backends = Backends.resolve(platform, attention_impl=settings.attention_impl,
                                    matmul_impl=settings.matmul_impl, dtype=config.dtype,
                                    tensor_parallel_size=parallel.tensor_parallel_size)
        self.attention_impl, self.matmul_impl = backends.attention, backends.matmul
        if platform == "cpu" and self.kv_dtype == jnp.bfloat16 and self.attention_impl != "native":
            log.warning("bfloat16 KV pages with the %s attention on CPU slow every step: XLA:CPU writes new K/V "
                        "into bfloat16 pages by converting whole page arrays (the native kernel writes them "
                        "itself; docs/numerics.md)", self.attention_impl)

        num_kv_heads = kv_heads_for_tp(config, parallel.tensor_parallel_size)
        kv_shape = (num_pages + 1, page_size, num_kv_heads, config.head_dim)  # + the scratch page
        ranges = stage_layer_ranges(config.n_layers, parallel.pipeline_parallel_size)
        self.stages = [self._build_stage(i, model, ranges[i], meshes[i], kv_shape) for i in range(len(ranges))]
        self.multi_process = not all(stage.local for stage in self.stages)
        self.feeds_sampled_tokens = len(self.stages) == 1  # the one stage samples and embeds (fed_tokens)
        self.drafter = self._build_drafter() if isinstance(proposer, DraftModelProposer) else None
        if self.stages[0].mesh.devices.flat[0].process_index != 0:
            raise ConfigError("the leader (process 0) must hold the first pipeline stage: give every process the "
                              "same number of devices")
        self.followers = None  # the leader's multihost.PlanSender, attached by the builder
        self.step_timeout = step_timeout
        # A result transfer from another process cannot be given a deadline, so the leader waits on
        # a helper thread and stops waiting at the deadline (the wait is abandoned, not the step).
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, "orca-jax-result") if self.multi_process else None
        self._follower_outputs: collections.deque = collections.deque()  # a follower's recent stage outputs
        self._last_local_output = None
        self._zero_penalties: dict[int, tuple[jax.Array, jax.Array]] = {}
        self._warmed_up = False
        self._compilations_after_warmup = 0
        self._first_runs: collections.deque[StepPlan] = collections.deque()  # padding steps for run_first_runs
        self._programs_run: set[tuple[str, int]] = set()  # ("layers", T) and ("head", R) run at least once
        self.stats = RunnerStats()

    def _build_stage(self, index: int, model: Decoder, layers: range, mesh: Mesh, kv_shape) -> Stage:
        first, last = index == 0, index == self.parallel.pipeline_parallel_size - 1
        replicated = NamedSharding(mesh, PartitionSpec())
        owners = {device.process_index for device in mesh.devices.flat}
        if len(owners) > 1:
            raise ConfigError(f"pipeline stage {index} spans processes {sorted(owners)}: a stage's "
                              f"tensor_parallel_size={mesh.size} devices must be on one process (make tp divide "
                              "each process's device count)")
        if owners != {jax.process_index()}:
            return Stage(index, layers, mesh, replicated, first, last, local=False)
        graphdef, state = nnx.split(DecoderStage(model, layers, first=first, last=last))
        num_kv_heads = kv_shape[2]
        widen = num_kv_heads != self.config.n_kv_heads
        native_rows = self.matmul_impl == "native" and bool(float_rows_methods(model))
        # The float matrices as rows for the native kernel: a stage rebuilt with those methods.
        stage_rows = functools.partial(float_rows_stage, model, layers, first=first, last=last, sharding=replicated)
        if native_rows and self.weights is None:
            # Before placing (tp = 1, so nothing is widened): the rows are made once per array of the
            # given model and shared by every runner over it (runner/float_rows.py).
            graphdef, state = stage_rows(state=state)
        shardings = param_shardings(state, mesh)
        if self.weights is None:
            params = jax.device_put(replicate_kv_heads(state, num_kv_heads) if widen else state, shardings)
        else:
            # K/V projections that are widened to tp heads arrive whole on every device (their
            # original head count does not split over tp), are widened there, then resharded.
            params = self.weights.stage_params(state, kv_projections_replicated(shardings, replicated) if widen
                                               else shardings, layers=layers, tied=self.config.tie_word_embeddings)
            if widen:
                params = jax.device_put(replicate_kv_heads(params, num_kv_heads), shardings)
            if native_rows:
                graphdef, params = stage_rows(state=params)
        kv_sharding = kv_cache_sharding(mesh)
        zeros = jax.jit(lambda: jnp.zeros(kv_shape, self.kv_dtype), out_shardings=kv_sharding)
        attention = sharded_paged_attention(self.attention_impl, mesh)
        param_treedef = jax.tree.structure(params)

        def run_layers(param_leaves, kv_caches, token_pages, x, packed_inputs, fed_tokens):
            stage = nnx.merge(graphdef, jax.tree.unflatten(param_treedef, param_leaves))
            inputs: StepInputs = packed_inputs.unpack()
            token_ids = inputs.token_ids
            if fed_tokens is not None:
                fed = fed_tokens[jnp.maximum(inputs.token_source, 0)]
                token_ids = jnp.where(inputs.token_source >= 0, fed, token_ids)
            x, kv_caches = stage(token_ids if first else x, inputs.attention, kv_caches, inputs.logits_index,
                                 attention)
            if token_pages is not None:
                token_pages = write_tokens(token_pages, token_ids, inputs.attention.slot_mapping)
            return x, kv_caches, token_pages

        def run_head(param_leaves, row_tokens, packed_sampling, packed_speculation, token_pages, draft_probs):
            sampling: SamplingMetadata = packed_sampling.unpack()
            num_rows = sampling.temperature.shape[0]  # the row bucket: only its rows get logits
            head = nnx.merge(graphdef, jax.tree.unflatten(param_treedef, param_leaves))
            logits = head.logits(row_tokens[:num_rows], sampling.num_real_rows)
            sampled = sample(logits, sampling)
            fed = jnp.zeros(self.kv_layout.max_logit_rows, jnp.int32).at[:num_rows].set(sampled.tokens)
            if packed_speculation is None:
                return sampled, fed
            return verify_and_propose(self.proposer, token_pages, logits, sampled, sampling,
                                      packed_speculation.unpack(), draft_probs), fed

        # Pinning output placements keeps the donated caches' sharding identical across steps, so a
        # step's outputs are always valid inputs of the next.
        token_pages = None
        if last and isinstance(self.proposer, NgramProposer):
            token_pages = jax.device_put(jnp.zeros(kv_shape[:2], jnp.int32), replicated)
        fed_tokens = jax.device_put(jnp.zeros(self.kv_layout.max_logit_rows, jnp.int32), replicated) if first and last \
            else None
        layers_program = jax.jit(run_layers, donate_argnums=(1, 2),
                                 out_shardings=(replicated, kv_sharding, None if token_pages is None else replicated))
        head_program = jax.jit(run_head, out_shardings=replicated) if last else None
        return Stage(index, layers, mesh, replicated, first, last, local=True, params=params,
                     param_leaves=jax.tree.leaves(params), linear_methods=linear_methods(nnx.merge(graphdef, params)),
                     kv_caches=[(zeros(), zeros()) for _ in layers], token_pages=token_pages, fed_tokens=fed_tokens,
                     layers_program=layers_program, head_program=head_program)

    def _build_drafter(self) -> DraftModelRunner:
        last = self.stages[-1]
        if self.multi_process:
            raise ConfigError("speculative_config.method='draft_model' runs on one process only; use method "
                              "'ngram' across processes, or run every pipeline stage in one process")

        def example_inputs(kind: str, size: int):
            if kind == "layers":
                return (StepInputs.of(padding_plan(size, self.buckets.row_buckets[0], self.kv_layout,
                                                   self.config.vocab_size)),)
            plan = padding_plan(self.buckets.tokens[0], size, self.kv_layout, self.config.vocab_size)
            metadata = self._sampling_metadata(plan, last), self._speculation_metadata(plan, last)
            return tuple(packed.unpack() for packed in jax.device_put(metadata, last.replicated))

        def compile_program(name, args, depends_on, program):
            return self.executable_store.load_or_compile(
                name, args, repr((depends_on, self.attention_impl, self.matmul_precision)),
                lambda: self.lower(program, args), jax.tree.structure(jax.eval_shape(program, *args)),
                list(last.mesh.devices.flat))

        return DraftModelRunner(self.proposer, last.mesh, last.replicated, self.kv_layout, self.buckets,
                                self.attention_impl, self.kv_dtype, self.parallel.tensor_parallel_size,
                                compile_program, example_inputs)

    @property
    def num_pages(self) -> int:
        return self.kv_layout.num_pages

    @property
    def page_size(self) -> int:
        return self.kv_layout.page_size

    @property
    def max_pages_per_seq(self) -> int:
        return self.kv_layout.max_pages_per_seq

    def layout_settings(self) -> dict[str, str]:
        """Everything the processes of one model must agree on, one entry per setting (multi-host
        compares them at start-up and names each that differs)."""
        settings = {"kv_dtype": self.kv_dtype.name, "attention_impl": self.attention_impl,
                    "matmul_precision": self.matmul_precision, "matmul_impl": self.matmul_impl,
                    "proposer": repr(self.proposer), "quantization": self.quantization,
                    "weights": "the model's arrays" if self.weights is None else self.weights.describe(),
                    "stage_devices": repr([[d.id for d in s.mesh.devices.flat] for s in self.stages])}
        for name, value in (("model", self.config), ("parallel", self.parallel), ("kv_layout", self.kv_layout),
                            ("buckets", self.buckets)):
            settings.update({f"{name}.{f.name}": repr(getattr(value, f.name)) for f in dataclasses.fields(value)})
        return settings

    def close(self) -> None:
        """A multi-host leader's last word: the followers exit 0. Nothing to do on one process."""
        if self.followers is not None:
            self.followers.close()
            self.followers = None

    @property
    def last_stage_process(self) -> int:
        return self.stages[-1].mesh.devices.flat[0].process_index

    def describe(self) -> str:
        tp, pp = self.parallel.tensor_parallel_size, self.parallel.pipeline_parallel_size
        stages = ", ".join(f"layers {s.layers.start}-{s.layers.stop - 1} on {[d.id for d in s.mesh.devices.flat]}"
                           for s in self.stages)
        drafts = "" if self.proposer is None else f", n-gram drafts of up to {self.proposer.num_speculative_tokens}"
        if self.drafter is not None:
            drafts = f", {self.drafter.describe()}"
        weights = "" if self.weights is None else f"; weights: {self.weights.summary()}"
        quantized = "" if self.quantization == "none" else f", weights quantized ({self.quantization})"
        return (f"tp {tp} x pp {pp} ({stages}), attention {self.attention_impl}, matmuls {self.matmul_impl}, "
                f"KV pages {self.kv_dtype.name}{quantized}{drafts}{weights}")

    # ---- compilation ---------------------------------------------------------------------
    def warm_up(self, show_progress: bool = True) -> float:
        """Compiles (or loads) every program, then runs one padding step through every stage, which
        on several processes also opens each transfer between them. Returns seconds taken. The
        other programs' first runs are left to `run_first_runs` (see there)."""
        start = time.perf_counter()
        self.compile_programs(show_progress)
        self._first_runs = collections.deque(self._padding_plans())
        self.run_first_runs(limit=1)
        elapsed = time.perf_counter() - start
        self.stats = RunnerStats()
        if show_progress:
            loaded = self.executable_store.loaded
            print(f"warm-up: {len(self.buckets.tokens)} token buckets {list(self.buckets.tokens)} + "
                  f"{len(self.buckets.row_buckets)} row buckets {list(self.buckets.row_buckets)} x {len(self.stages)} "
                  f"stage(s) ready in {elapsed:.1f} s ({loaded} program(s) loaded from "
                  f"{self.executable_store.directory}, the others compiled)", file=sys.stderr)
        return elapsed

    def _padding_plans(self) -> list[StepPlan]:
        """Padding steps that between them run every layers program (token bucket) and every head
        program (row bucket), smallest first."""
        tokens, rows = self.buckets.tokens, self.buckets.row_buckets
        return [padding_plan(tokens[i] if i < len(tokens) else tokens[0], rows[i] if i < len(rows) else rows[0],
                             self.kv_layout, self.config.vocab_size) for i in range(max(len(tokens), len(rows)))]

    def run_first_runs(self, limit: int | None = None) -> int:
        """Runs up to `limit` (None: all) padding steps for programs that have not run yet; returns
        how many such padding steps remain. A program's first run is slow: XLA:CPU builds each of
        its YNNPACK dot fusions' plans then (slinky simplifying loops, ~3 ms a dot), so the 30-layer
        SmolLM2 program of 128 tokens took 1.0 s the first time and 0.2 s after (AMD EPYC Zen 3,
        2026-12-03), ~6 s for all 10 token buckets. Warm-up runs only the smallest, to keep start-up
        short; the server's engine thread runs the others while it has no request (async_engine),
        and the offline `LLM` all of them before it returns, so that stall does not fall on the
        first request of each bucket."""
        timeout = 10 * self.step_timeout if self.step_timeout else None
        done = 0
        while self._first_runs and (limit is None or done < limit):
            plan = self._first_runs[0]
            if not self._has_run(plan):
                self._wait(self.run_plan(plan), timeout)
                done += 1
            self._first_runs.popleft()  # only once it ran: the count another thread reads stays true
        return len(self._first_runs)

    def _has_run(self, plan: StepPlan) -> bool:
        """Whether both programs `plan` calls have run at least once (their slow first run is done)."""
        return {("layers", plan.bucket[0]), ("head", plan.bucket[1])} <= self._programs_run

    def compile_programs(self, show_progress: bool = False) -> None:
        """Every program a step can call, for the stages this process owns, ahead of time. A
        follower process calls only this: the leader's padding step reaches it as a plan."""
        programs = [(stage, "layers", t) for stage in self.stages if stage.local for t in self.buckets.tokens]
        programs += [(stage, "head", r) for stage in self.stages if stage.local and stage.last
                     for r in self.buckets.row_buckets]
        for stage, name, size in tqdm(programs, desc="compiling", disable=not show_progress, leave=False):
            stage.executables[name, size] = self._compile(stage, name, size)
        if self.drafter is not None:
            self.drafter.compile_programs()
        self._warmed_up = True

    def _compile(self, stage: Stage, name: str, size: int):
        if name == "layers":
            placed = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=stage.replicated)  # noqa: E731
            plan = padding_plan(size, self.buckets.row_buckets[0], self.kv_layout, self.config.vocab_size)
            inputs = jax.tree.map(lambda a: placed(a.shape, a.dtype), pack(StepInputs.of(plan)))
            x = None if stage.first else placed((size, self.config.d_model), jnp.dtype(self.config.dtype))
            args = (stage.param_leaves, stage.kv_caches, stage.token_pages, x, inputs, stage.fed_tokens)
            program = stage.layers_program
            out_tree = jax.tree.structure((0, stage.kv_caches, stage.token_pages))
        else:
            plan = padding_plan(self.buckets.tokens[0], size, self.kv_layout, self.config.vocab_size)
            row_tokens = jax.ShapeDtypeStruct((self.kv_layout.max_logit_rows, self.config.d_model),
                                              jnp.dtype(self.config.dtype), sharding=stage.replicated)
            draft_probs = None if self.drafter is None else jax.ShapeDtypeStruct(
                (size, self.config.vocab_size), jnp.float32, sharding=stage.replicated)
            # Compiled for the metadata on every device of the stage, where a step's call places it.
            metadata = jax.device_put((self._sampling_metadata(plan, stage), self._speculation_metadata(plan, stage)),
                                      stage.replicated)
            args = (stage.param_leaves, row_tokens, *metadata, stage.token_pages, draft_probs)
            program = stage.head_program
            out_tree = jax.tree.structure((_result_shapes(size, self.kv_layout), 0))
        return self.executable_store.load_or_compile(
            # The kv_layout fixes where each field sits in the packed inputs (packing.py).
            f"{name}{size}-stage{stage.index}", args,
            repr((self.config, self.attention_impl, self.matmul_precision, self.matmul_impl, self.proposer,
                  self.kv_layout, stage.linear_methods)),
            lambda: self.lower(program, args), out_tree, list(stage.mesh.devices.flat))

    def lower(self, program, args):
        """Traces `program` with the runner's matmul precision: it is fixed in the program's dots."""
        with jax.default_matmul_precision(self.matmul_precision):
            return program.lower(*args)

    def _program(self, stage: Stage, name: str, size: int):
        """The compiled program for a shape; one missing after warm-up is compiled now and counted."""
        compiled = stage.executables.get((name, size))
        if compiled is None:
            if self._warmed_up:
                self._compilations_after_warmup += 1
                log.warning("compiling %s program of size %d after warm-up: a stall; this shape was not "
                            "among the buckets", name, size)
            compiled = stage.executables[name, size] = self._compile(stage, name, size)
        return compiled

    @property
    def num_compilations_after_warmup(self) -> int:
        drafter = 0 if self.drafter is None else self.drafter.num_compilations_after_warmup
        return self._compilations_after_warmup + drafter

    # ---- one step ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> dict[str, StepTokens]:
        """Runs one step and waits for it (dispatch + collect)."""
        return self.collect(self.dispatch(plan))

    def dispatch(self, plan: StepPlan) -> Pending:
        """Starts the step on the devices; returns without waiting."""
        start = time.perf_counter()
        self.stats.steps += 1
        self.stats.padded_tokens += len(plan.token_ids)
        self.stats.real_tokens += plan.num_real_tokens
        self.stats.buckets[plan.bucket] += 1
        self.stats.first_runs += not self._has_run(plan)
        result = self.run_plan(plan)
        self.stats.device_s += time.perf_counter() - start
        return Pending(plan, result)

    def collect(self, pending: Pending) -> dict[str, StepTokens]:
        """Waits for a dispatched step and copies back its result: the step's one device -> host copy
        (with speculation the next drafts ride in it: proposing adds none)."""
        start = time.perf_counter()
        result = self._wait(pending.result, self.step_timeout)
        self.stats.device_s += time.perf_counter() - start
        if isinstance(result, SpeculativeOutput):
            s = result.sampled
            return step_tokens(pending.plan, s.tokens, s.logprob, s.top_ids, s.top_logprobs, result.accepted,
                               result.drafts, result.num_drafts)
        return step_tokens(pending.plan, result.tokens, result.logprob, result.top_ids, result.top_logprobs)

    def _wait(self, result, timeout: float | None):
        if self._waiter is None:
            return jax.device_get(result)
        try:
            return self._waiter.submit(jax.device_get, result).result(timeout)
        except concurrent.futures.TimeoutError:
            raise RunnerLost(f"no step result from the other processes within {timeout:.0f} s: a follower "
                             "stalled or died") from None
        except jax.errors.JaxRuntimeError as error:
            raise RunnerLost(f"a follower process failed: {error}") from error

    def run_plan(self, plan: StepPlan) -> SamplerOutput | SpeculativeOutput:
        """Dispatches a plan through every stage; returns the result on the leader's devices (on a
        follower: a placeholder, its data on the leader)."""
        self._programs_run |= {("layers", plan.bucket[0]), ("head", plan.bucket[1])}
        if not self.multi_process:
            return self._run_stages(plan)
        if self.followers is not None:
            self.followers.send(plan)
        try:
            return self._run_stages(plan)
        except Exception as error:
            # The other processes are already running this plan and expect this one's side of
            # every transfer: one process failing its part leaves them out of step for good.
            raise RunnerLost(f"process {jax.process_index()} failed a step the others are running: {error}") from error

    def _run_stages(self, plan: StepPlan) -> SamplerOutput | SpeculativeOutput:
        num_tokens, num_rows = plan.bucket
        x = None
        for stage in self.stages:
            if not stage.first:  # the previous stage's activations, to this stage's devices
                x = self._move(x, self.stages[stage.index - 1], stage.replicated,
                               jax.ShapeDtypeStruct((num_tokens, self.config.d_model), jnp.dtype(self.config.dtype)))
            if stage.local:
                x = self._last_local_output = self.run_stage(stage, plan, x)
        if self.multi_process:
            x = self._move(x, self.stages[-1], self.stages[0].replicated, _result_shapes(num_rows, self.kv_layout))
        return x

    def run_stage(self, stage: Stage, plan: StepPlan, x):
        """A local stage's programs on the plan and the previous stage's activations `x` (None for
        the first stage): returns the activations for the next stage, or the sampled tokens."""
        num_tokens, num_rows = plan.bucket
        # The packed numpy buffers go into the compiled call as they are: the call places them on the
        # stage's devices for ~5 us an array, where `jax.device_put` costs ~0.1 ms of host time an array
        # (jax 0.10, AMD EPYC Zen 3).
        inputs = pack(StepInputs.of(plan))
        x, stage.kv_caches, stage.token_pages = self._program(stage, "layers", num_tokens)(
            stage.param_leaves, stage.kv_caches, stage.token_pages, x, inputs, stage.fed_tokens)
        if stage.last:
            sampling, speculation = self._sampling_metadata(plan, stage), self._speculation_metadata(plan, stage)
            draft_probs = None
            if self.drafter is not None:
                # The draft model's programs take the step's arrays unpacked (sliced here, on the device).
                draft_inputs, draft_sampling, draft_speculation = (
                    packed.unpack() for packed in jax.device_put((inputs, sampling, speculation), stage.replicated))
                draft_probs = self.drafter.catch_up(plan, draft_inputs, draft_sampling, draft_speculation)
            x, fed_tokens = self._program(stage, "head", num_rows)(stage.param_leaves, x, sampling, speculation,
                                                                   stage.token_pages, draft_probs)
            if stage.first:
                stage.fed_tokens = fed_tokens
            if self.drafter is not None:
                x = self.drafter.propose(plan, x, draft_sampling, draft_speculation)
        return x

    def _move(self, value, source: Stage, destination: NamedSharding, shapes):
        """`device_put` of a stage's output to `destination`. Between processes both sides make the
        call: the holder with the data, the other with a placeholder of the same shapes."""
        receiving = destination.mesh.devices.flat[0].process_index == jax.process_index()
        if not source.local and not receiving:
            return None  # between two other processes
        if not source.local:
            value = jax.tree.map(
                lambda s: jax.make_array_from_single_device_arrays(s.shape, source.replicated, [], dtype=s.dtype),
                shapes)
        return jax.device_put(value, destination)

    def follow_plan(self, plan: StepPlan) -> None:
        """A follower's step: the same calls as the leader's, its results staying on the leader. At
        most a few steps run ahead (past ~32 executions queued, transfers deadlock)."""
        self.run_plan(plan)
        self._follower_outputs.append(self._last_local_output)
        if len(self._follower_outputs) > self.max_in_flight + 1:
            jax.block_until_ready(self._follower_outputs.popleft())

    def _sampling_metadata(self, plan: StepPlan, stage: Stage) -> SamplingMetadata:
        fields = vars(plan.sampling).copy()  # the plan's SamplingMetadata in numpy
        if fields["output_counts"] is None:
            fields["output_counts"], fields["seen_tokens"] = self._zero_penalty_arrays(plan.bucket[1], stage)
        else:  # placed on their own, so the packed layout is the same with penalties or without
            fields["output_counts"], fields["seen_tokens"] = jax.device_put(
                (fields["output_counts"], fields["seen_tokens"]), stage.replicated)
        return pack(SamplingMetadata(**fields))  # numpy buffers, placed by the head's call (as run_stage's inputs)

    def _speculation_metadata(self, plan: StepPlan, stage: Stage) -> SpeculationMetadata | None:
        if plan.speculation is None:
            return None
        return pack(dataclasses.replace(plan.speculation, block_tables=plan.block_tables))

    def _zero_penalty_arrays(self, num_seqs: int, stage: Stage) -> tuple[jax.Array, jax.Array]:
        """Kept on device per bucket, so steps without penalties never ship [S, V] arrays."""
        if num_seqs not in self._zero_penalties:
            vocab = self.config.vocab_size
            self._zero_penalties[num_seqs] = jax.device_put(
                (np.zeros((num_seqs, vocab), np.int32), np.zeros((num_seqs, vocab), bool)), stage.replicated
            )
        return self._zero_penalties[num_seqs]


def _result_shapes(num_rows: int, kv: KVLayout) -> SamplerOutput | SpeculativeOutput:
    """The shapes of the head's output for `num_rows` logit rows (placeholders between processes)."""
    def shape(*dims, dtype):
        return jax.ShapeDtypeStruct(dims, jnp.dtype(dtype))

    sampled = SamplerOutput(tokens=shape(num_rows, dtype=jnp.int32), logprob=shape(num_rows, dtype=jnp.float32),
                            top_ids=shape(num_rows, MAX_LOGPROBS, dtype=jnp.int32),
                            top_logprobs=shape(num_rows, MAX_LOGPROBS, dtype=jnp.float32))
    if not kv.num_speculative_tokens:
        return sampled
    return SpeculativeOutput(sampled=sampled, accepted=shape(num_rows, dtype=bool),
                             drafts=shape(kv.max_num_seqs, kv.num_speculative_tokens, dtype=jnp.int32),
                             num_drafts=shape(kv.max_num_seqs, dtype=jnp.int32))
