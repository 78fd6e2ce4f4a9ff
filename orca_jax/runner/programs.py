"""Compilation, warm-up and first runs: every program a step can call, by stage and shape.

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
import logging
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from orca_jax.config import ModelConfig
from orca_jax.engine.step_plan import Buckets, KVLayout, StepPlan, padding_plan
from orca_jax.runner.compile_cache import ExecutableStore
from orca_jax.runner.stage import Stage, result_shapes
from orca_jax.runner.step_inputs import HeadInputs, LayersInputs

log = logging.getLogger(__name__)


def lower(program, args, matmul_precision: str):
    """Traces `program` with the runner's matmul precision: it is fixed in the program's dots."""
    with jax.default_matmul_precision(matmul_precision):
        return program.lower(*args)


class Programs:
    """The compiled programs of a runner's local stages (in each `Stage.executables`) and which of
    them have run once. A stored program is keyed by what it depends on: the model config, the
    attention and matmul implementations, the matmul precision, the proposer, the KV layout and the
    stage's linear methods. `drafter`, the draft model's runner (draft_model.py), is held here alone
    (the runner sets it once built, and reads it here): its programs are compiled, through
    `compile_draft`, and counted with the target's."""

    def __init__(self, stages: list[Stage], config: ModelConfig, buckets: Buckets, kv_layout: KVLayout,
                 executable_store: ExecutableStore, layers_inputs: LayersInputs, head_inputs: HeadInputs, *,
                 attention_impl: str, matmul_impl: str, matmul_precision: str, proposer: Any):
        self.stages, self.config, self.buckets, self.kv_layout = stages, config, buckets, kv_layout
        self.executable_store, self.layers_inputs, self.head_inputs = executable_store, layers_inputs, head_inputs
        self.attention_impl, self.matmul_impl, self.matmul_precision = attention_impl, matmul_impl, matmul_precision
        self.proposer = proposer
        self.drafter: Any = None  # DraftModelRunner | None
        self._warmed_up = False
        self._compilations_after_warmup = 0
        self._first_runs: collections.deque[StepPlan] = collections.deque()  # padding steps for run_first_runs
        self._programs_run: set[tuple[str, int]] = set()  # ("layers", T) and ("head", R) run at least once

    # ---- compilation ---------------------------------------------------------------------
    def compile_all(self, show_progress: bool = False) -> None:
        """Every program a step can call, for the stages this process owns, ahead of time."""
        programs = [(stage, "layers", t) for stage in self.stages if stage.local for t in self.buckets.tokens]
        programs += [(stage, "head", r) for stage in self.stages if stage.local and stage.last
                     for r in self.buckets.row_buckets]
        for stage, name, size in tqdm(programs, desc="compiling", disable=not show_progress, leave=False):
            stage.executables[name, size] = self.compile(stage, name, size)
        if self.drafter is not None:
            self.drafter.compile_programs()
        self._warmed_up = True

    def compile(self, stage: Stage, name: str, size: int):
        """Stage's `name` program ("layers" or "head") for `size` tokens or logit rows, compiled or
        loaded from the executable store."""
        if name == "layers":
            placed = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=stage.replicated)  # noqa: E731
            plan = padding_plan(size, self.buckets.row_buckets[0], self.kv_layout, self.config.vocab_size)
            inputs = jax.tree.map(lambda a: placed(a.shape, a.dtype), self.layers_inputs(plan))
            x = None if stage.first else placed((size, self.config.d_model), jnp.dtype(self.config.dtype))
            args = (stage.param_leaves, stage.kv_cache, stage.token_pages, x, inputs, stage.fed_tokens)
            program = stage.layers_program
            out_tree = jax.tree.structure((0, stage.kv_cache, stage.token_pages))
        else:
            plan = padding_plan(self.buckets.tokens[0], size, self.kv_layout, self.config.vocab_size)
            row_tokens = jax.ShapeDtypeStruct((self.kv_layout.max_logit_rows, self.config.d_model),
                                              jnp.dtype(self.config.dtype), sharding=stage.replicated)
            draft_probs = None if self.drafter is None else jax.ShapeDtypeStruct(
                (size, self.config.vocab_size), jnp.float32, sharding=stage.replicated)
            # Compiled for the metadata on every device of the stage, where a step's call places it.
            metadata = jax.device_put((self.head_inputs.sampling(plan, stage.replicated),
                                       self.head_inputs.speculation(plan)), stage.replicated)
            args = (stage.head_param_leaves, row_tokens, *metadata, stage.token_pages, draft_probs)
            program = stage.head_program
            out_tree = jax.tree.structure((result_shapes(size, self.kv_layout), 0))
        return self.executable_store.load_or_compile(
            # The kv_layout fixes where each field sits in the packed inputs (packing.py).
            f"{name}{size}-stage{stage.index}", args,
            repr((self.config, self.attention_impl, self.matmul_precision, self.matmul_impl, self.proposer,
                  self.kv_layout, stage.linear_methods)),
            lambda: lower(program, args, self.matmul_precision), out_tree, list(stage.mesh.devices.flat))

    def compile_draft(self, name: str, args, depends_on: str, program, devices: list):
        """One of the draft model's programs (draft_model.py), compiled or loaded from the same store
        at the same matmul precision."""
        return self.executable_store.load_or_compile(
            name, args, repr((depends_on, self.attention_impl, self.matmul_precision)),
            lambda: lower(program, args, self.matmul_precision), jax.tree.structure(jax.eval_shape(program, *args)),
            devices)

    def get(self, stage: Stage, name: str, size: int):
        """The compiled program for a shape; one missing after warm-up is compiled now and counted."""
        compiled = stage.executables.get((name, size))
        if compiled is None:
            if self._warmed_up:
                self._compilations_after_warmup += 1
                log.warning("compiling %s program of size %d after warm-up: a stall; this shape was not "
                            "among the buckets", name, size)
            compiled = stage.executables[name, size] = self.compile(stage, name, size)
        return compiled

    @property
    def num_compilations_after_warmup(self) -> int:
        drafter = 0 if self.drafter is None else self.drafter.num_compilations_after_warmup
        return self._compilations_after_warmup + drafter

    # ---- warm-up and first runs ----------------------------------------------------------
    def warm_up(self, run: Callable[[StepPlan], Any], show_progress: bool) -> float:
        """Compiles (or loads) every program, then runs (`run`: dispatch and wait) one padding step
        through every stage, which on several processes also opens each transfer between them.
        Returns seconds taken. The other programs' first runs are left to `run_first_runs`."""
        start = time.perf_counter()
        self.compile_all(show_progress)
        self._first_runs = collections.deque(self._padding_plans())
        self.run_first_runs(run, limit=1)
        elapsed = time.perf_counter() - start
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

    def run_first_runs(self, run: Callable[[StepPlan], Any], limit: int | None = None) -> int:
        """Runs (`run`: dispatch and wait) up to `limit` (None: all) padding steps for programs that
        have not run yet; returns how many such padding steps remain (ModelRunner.run_first_runs
        tells why)."""
        done = 0
        while self._first_runs and (limit is None or done < limit):
            plan = self._first_runs[0]
            if not self.has_run(plan):
                run(plan)
                done += 1
            self._first_runs.popleft()  # only once it ran: the count another thread reads stays true
        return len(self._first_runs)

    def has_run(self, plan: StepPlan) -> bool:
        """Whether both programs `plan` calls have run at least once (their slow first run is done)."""
        return {("layers", plan.bucket[0]), ("head", plan.bucket[1])} <= self._programs_run

    def mark_run(self, plan: StepPlan) -> None:
        self._programs_run |= {("layers", plan.bucket[0]), ("head", plan.bucket[1])}
