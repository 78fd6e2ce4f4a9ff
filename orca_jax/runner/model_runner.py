"""The model runner: the only owner of jit, buckets, devices, meshes, parameters and KV arrays, and
the public face of the runner package. It builds the stages and runs the steps; the parts live by
role: stage building (stage.py), compilation, warm-up and first runs (programs.py), the step's
packed host arrays (step_inputs.py, packing.py), the draft model (draft_model.py) and the transfers
between stages and processes (parallel/transfers.py).

The model is split into `pipeline_parallel_size` stages of contiguous layers. Each `Stage` has its
own mesh of `tensor_parallel_size` devices, its own parameters and KV arrays (sharded over 'tp' by
the logical-axis rules) and its own jitted programs; with one stage it is the whole model on one
mesh. A step (`run_plan`) places the plan's arrays on every stage, runs the stages in order and
moves the activations [T, D] from one stage's mesh to the next with `jax.device_put`. Nothing
waits: jax dispatches asynchronously, so while stage 1 computes step n, stage 0 can already run
step n + 1 (the engine keeps up to `max_in_flight` = pp steps dispatched). `collect` copies back
the step's one small result (sampled tokens). A step's many small host arrays (token ids, slots,
block tables, sampling parameters) travel as one buffer per dtype (packing.py), and the programs
take the parameters as leaves flattened once: at one sequence, host work per step was otherwise as
long as several layers.

Across processes (parallel/multihost.py) a stage lives on one process; each process builds only the
stages it owns, the leader sends every plan to the followers before running it, and every process
runs every plan: its own stages, and its side of each transfer between processes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import jax
import jax.numpy as jnp

from orca_jax.config import ConfigError, EngineConfig, activations_for, kv_page_dtype, matmul_precision_for
from orca_jax.engine.step_plan import Buckets, KVLayout, RunnerLost, StepPlan, StepTokens, step_tokens
from orca_jax.model.backends import Backends
from orca_jax.model.decoder import Decoder
from orca_jax.model.sampler import SamplerOutput
from orca_jax.parallel import stage_meshes
from orca_jax.parallel.layout import check_parallel, kv_heads_for_tp, stage_layer_ranges
from orca_jax.parallel.transfers import FollowerPacing, ResultWaiter, move
from orca_jax.runner.compile_cache import ExecutableStore, enable_compilation_cache
from orca_jax.runner.draft_model import build_drafter
from orca_jax.runner.huge_pages import back_with_huge_pages
from orca_jax.runner.programs import Programs
from orca_jax.runner.speculation import DraftModelProposer, NgramProposer, SpeculativeOutput
from orca_jax.runner.stage import Stage, StageRecipe, build_stage, result_shapes
from orca_jax.runner.step_inputs import HeadInputs, LayersInputs

log = logging.getLogger(__name__)


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
class Pending:
    """A dispatched step: its plan and the device arrays of its result (not yet copied back)."""

    plan: StepPlan
    result: SamplerOutput | SpeculativeOutput


class ModelRunner:
    """Builds the stages of a model over its devices and runs StepPlans on them (the Runner contract
    of engine/step_plan.py)."""

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
        self.kv_dtype = jnp.dtype(kv_page_dtype(settings.cache.kv_cache_dtype, config.dtype))
        self.matmul_precision = matmul_precision_for(settings.matmul_precision, config.dtype)
        self.weights = weights
        self.quantization = settings.effective_quantization
        self.quantization_activations = activations_for(settings.quantization_activations, self.quantization)
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
        recipe = StageRecipe(model, parallel.pipeline_parallel_size,
                             kv_shape=(num_pages + 1, page_size, num_kv_heads, config.head_dim),  # + the scratch page
                             kv_dtype=self.kv_dtype, kv_layout=self.kv_layout, attention_impl=self.attention_impl,
                             matmul_impl=self.matmul_impl, proposer=proposer, weights=weights)
        ranges = stage_layer_ranges(config.n_layers, parallel.pipeline_parallel_size)
        self.stages = [build_stage(recipe, i, ranges[i], meshes[i]) for i in range(len(ranges))]
        self.multi_process = not all(stage.local for stage in self.stages)
        self.feeds_sampled_tokens = len(self.stages) == 1  # the one stage samples and embeds (fed_tokens)
        self.layers_inputs, self.head_inputs = LayersInputs(config), HeadInputs(config.vocab_size)
        self.programs = Programs(self.stages, config, buckets, self.kv_layout,
                                 executable_store or ExecutableStore.default(), self.layers_inputs, self.head_inputs,
                                 attention_impl=self.attention_impl, matmul_impl=self.matmul_impl,
                                 matmul_precision=self.matmul_precision, proposer=proposer)
        if isinstance(proposer, DraftModelProposer):
            if self.multi_process:
                raise ConfigError("speculative_config.method='draft_model' runs on one process only; use method "
                                  "'ngram' across processes, or run every pipeline stage in one process")
            self.programs.drafter = build_drafter(
                proposer, self.stages[-1], self.kv_layout, buckets, config.vocab_size, self.attention_impl,
                self.kv_dtype, parallel.tensor_parallel_size, self.programs, self.layers_inputs, self.head_inputs)
        if platform == "cpu":  # every step streams the weights: in 2 MB pages (huge_pages.py)
            start = time.perf_counter()
            collapsed = back_with_huge_pages(self.weight_arrays())
            left = f"; {collapsed.refused} spans left in 4 KB pages ({collapsed.reason})" if collapsed.refused else ""
            # None moved: THP off (`never`) or a kernel before 6.1, which costs every step some speed.
            level = logging.WARNING if collapsed.refused and not collapsed.spans else logging.INFO
            log.log(level, "weights: %d MB moved into 2 MB pages in %.1f s%s", collapsed.megabytes,
                    time.perf_counter() - start, left)
        if self.stages[0].mesh.devices.flat[0].process_index != 0:
            raise ConfigError("the leader (process 0) must hold the first pipeline stage: give every process the "
                              "same number of devices")
        self.followers = None  # the leader's multihost.PlanSender, attached by the builder
        self.step_timeout = step_timeout
        self._waiter = ResultWaiter(self.multi_process, host_memory=platform == "cpu")
        self._pacing = FollowerPacing(self.max_in_flight)
        self._last_local_output = None
        self.stats = RunnerStats()

    def weight_arrays(self) -> list[jax.Array]:
        """What every decode step reads whole: this process's stages' parameters and a draft model's.
        (Not the KV pages: a step reads only its sequences' pages, and moving a default 1 GiB of
        them into 2 MB pages took 6 s of start-up here.)"""
        arrays = [leaf for stage in self.stages if stage.local for leaf in stage.param_leaves]
        drafter = self.programs.drafter
        return arrays + ([] if drafter is None else jax.tree.leaves(drafter.params))

    @property
    def executable_store(self) -> ExecutableStore:
        return self.programs.executable_store

    @executable_store.setter
    def executable_store(self, store: ExecutableStore) -> None:
        self.programs.executable_store = store

    @property
    def drafter(self):
        """The draft model's runner (draft_model.py), None without one: `programs` holds it, as it
        compiles the draft model's programs with the target's."""
        return self.programs.drafter

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
                    "quantization_activations": self.quantization_activations,
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

    # ---- compilation, warm-up and first runs (programs.py) --------------------------------
    def warm_up(self, show_progress: bool = True) -> float:
        """Compiles (or loads) every program, then runs one padding step through every stage, which
        on several processes also opens each transfer between them. Returns seconds taken. The
        other programs' first runs are left to `run_first_runs` (see there)."""
        elapsed = self.programs.warm_up(self._run_and_wait, show_progress)
        self.stats = RunnerStats()
        return elapsed

    def run_first_runs(self, limit: int | None = None) -> int:
        """Runs up to `limit` (None: all) padding steps for programs that have not run yet; returns
        how many such padding steps remain. A program's first run is slow: XLA:CPU builds each of
        its YNNPACK dot fusions' plans then (slinky simplifying loops, ~3 ms a dot), so the 30-layer
        SmolLM2 program of 128 tokens took 1.0 s the first time and 0.2 s after (AMD EPYC Zen 3,
        2026-12-03), ~6 s for all 10 token buckets. Warm-up runs only the smallest, to keep start-up
        short; the server's engine thread runs the others while it has no request (async_engine),
        and the offline `LLM` all of them before it returns, so that stall does not fall on the
        first request of each bucket."""
        return self.programs.run_first_runs(self._run_and_wait, limit)

    def _run_and_wait(self, plan: StepPlan) -> None:
        """A padding step, waited for (warm-up allows ten times the step timeout)."""
        self._waiter.wait(self.run_plan(plan), 10 * self.step_timeout if self.step_timeout else None)

    def compile_programs(self, show_progress: bool = False) -> None:
        """Every program a step can call, for the stages this process owns, ahead of time. A
        follower process calls only this: the leader's padding step reaches it as a plan."""
        self.programs.compile_all(show_progress)

    @property
    def num_compilations_after_warmup(self) -> int:
        return self.programs.num_compilations_after_warmup

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
        self.stats.first_runs += not self.programs.has_run(plan)
        result = self.run_plan(plan)
        self.stats.device_s += time.perf_counter() - start
        return Pending(plan, result)

    def collect(self, pending: Pending) -> dict[str, StepTokens]:
        """Waits for a dispatched step and copies back its result: the step's one device -> host copy
        (with speculation the next drafts ride in it: proposing adds none)."""
        start = time.perf_counter()
        result = self._waiter.wait(pending.result, self.step_timeout)
        self.stats.device_s += time.perf_counter() - start
        if isinstance(result, SpeculativeOutput):
            s = result.sampled
            return step_tokens(pending.plan, s.tokens, s.logprob, s.top_ids, s.top_logprobs, result.accepted,
                               result.drafts, result.num_drafts)
        return step_tokens(pending.plan, result.tokens, result.logprob, result.top_ids, result.top_logprobs)

    def run_plan(self, plan: StepPlan) -> SamplerOutput | SpeculativeOutput:
        """Dispatches a plan through every stage; returns the result on the leader's devices (on a
        follower: a placeholder, its data on the leader)."""
        self.programs.mark_run(plan)
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
                source = self.stages[stage.index - 1]
                x = move(x, source.replicated, source.local, stage.replicated,
                         jax.ShapeDtypeStruct((num_tokens, self.config.d_model), jnp.dtype(self.config.dtype)))
            if stage.local:
                x = self._last_local_output = self.run_stage(stage, plan, x)
        if self.multi_process:
            last = self.stages[-1]
            x = move(x, last.replicated, last.local, self.stages[0].replicated, result_shapes(num_rows, self.kv_layout))
        return x

    def run_stage(self, stage: Stage, plan: StepPlan, x):
        """A local stage's programs on the plan and the previous stage's activations `x` (None for
        the first stage): returns the activations for the next stage, or the sampled tokens. The
        packed host arrays go into the compiled calls as they are (step_inputs.py)."""
        num_tokens, num_rows = plan.bucket
        inputs = self.layers_inputs(plan)
        x, stage.kv_cache, stage.token_pages = self.programs.get(stage, "layers", num_tokens)(
            stage.param_leaves, stage.kv_cache, stage.token_pages, x, inputs, stage.fed_tokens)
        if stage.last:
            sampling = self.head_inputs.sampling(plan, stage.replicated)
            speculation = self.head_inputs.speculation(plan)
            draft_probs = None
            if self.drafter is not None:
                # The draft model's programs take the step's arrays unpacked (sliced here, on the device).
                draft_inputs, draft_sampling, draft_speculation = (
                    packed.unpack() for packed in jax.device_put((inputs, sampling, speculation), stage.replicated))
                draft_probs = self.drafter.catch_up(plan, draft_inputs, draft_sampling, draft_speculation)
            x, fed_tokens = self.programs.get(stage, "head", num_rows)(stage.head_param_leaves, x, sampling, speculation,
                                                                       stage.token_pages, draft_probs)
            if stage.first:
                stage.fed_tokens = fed_tokens
            if self.drafter is not None:
                x = self.drafter.propose(plan, x, draft_sampling, draft_speculation)
        return x

    def follow_plan(self, plan: StepPlan) -> None:
        """A follower's step: the same calls as the leader's, its results staying on the leader. At
        most a few steps run ahead (parallel/transfers.FollowerPacing)."""
        self.run_plan(plan)
        self._pacing.ran(self._last_local_output)
