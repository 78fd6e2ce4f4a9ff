"""The cost model measured on this machine: the runner's step time over a grid of shapes, then the
engine's own work per step. The only module of tuning/ that runs jax (through the runner).

The grid (`grid`): decode steps of every sequence bucket at a short and a long context; prompt
steps of every token bucket from 2 up, as one prompt, and up to 256 tokens also as a chunk after a
cached prefix and mixed (decodes beside one prompt chunk, as the chunked policy runs them; for the
two largest of those buckets, with the decodes at a short and a long context). Each
step is timed warm (its programs ran before) in rounds taken round-robin over the grid, so a burst
of other work on a shared machine spoils one round rather than one shape; a shape's time is the
median of its rounds. The engine's own work (`host_seconds`) is timed apart, on a burst of requests
stepped one iteration at a time.

`python -m orca_jax.tuning.measure` does both in a process of its own and adds the memory plan of
each KV budget (`main`), for `orca-jax tune`.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from orca_jax.engine.step_plan import StepPlan, padding_plan
from orca_jax.sampling_params import SamplingParams
from orca_jax.tuning.cost_model import CostModel, Timing, fit


def chunks_plan(runner, chunks: list[tuple[int, int]]) -> StepPlan:
    """A step of sequences given as (start, n): n new tokens after `start` cached ones, laid out and
    padded to its bucket as the runner does for a real step. Each sequence gets its own pages while
    the cache has them, then pages are reused (a timing never reads what they hold)."""
    num_tokens = sum(n for _, n in chunks)
    bucket_tokens, bucket_seqs = runner.buckets.pick(num_tokens, len(chunks))
    inputs = padding_plan(bucket_tokens, bucket_seqs, runner.kv_layout, runner.config.vocab_size)
    page_size, t, next_page = runner.page_size, 0, 0
    for row, (start, n) in enumerate(chunks):
        if start + n > runner.max_pages_per_seq * page_size:
            raise ValueError(f"a sequence of {start + n} tokens exceeds the runner's max_model_len")
        num_pages = -(-(start + n) // page_size)
        if next_page + num_pages > runner.num_pages:
            next_page = 0
        table = np.arange(next_page, next_page + num_pages, dtype=np.int32)
        next_page += num_pages
        pos = np.arange(start, start + n, dtype=np.int32)
        inputs.token_ids[t:t + n] = 1 + row % (runner.config.vocab_size - 1)
        inputs.positions[t:t + n] = pos
        inputs.segment_ids[t:t + n] = row
        inputs.slot_mapping[t:t + n] = table[pos // page_size] * page_size + pos % page_size
        inputs.block_tables[row, :num_pages] = table
        inputs.kv_lens[row] = start + n
        inputs.logits_index[row] = t + n - 1
        t += n
    # The padding after them is skipped, as in a real step.
    inputs.num_real_tokens, inputs.sampling.num_real_rows = num_tokens, np.int32(len(chunks))
    return inputs


def plan_chunks(plan: StepPlan) -> tuple[tuple[int, int], ...]:
    """A real step plan's sequences as (start, n), read back from its arrays."""
    counts = np.bincount(plan.segment_ids[:plan.num_real_tokens], minlength=len(plan.request_ids))
    return tuple((int(plan.kv_lens[row]) - int(n), int(n)) for row, n in enumerate(counts[:len(plan.request_ids)]))


def grid(token_buckets, seq_buckets, max_model_len: int) -> list[tuple[tuple[int, int], ...]]:
    """The measured shapes, as chunk tuples (module docstring). Steps of the chunked policy under
    load are mixed: a prompt chunk beside many decodes, so those are timed at every sequence bucket
    for two token buckets, with the decodes at a short and at a long context (a decode row's
    attention costs per position what a prompt token's does not: cost_model.py); above 256 tokens
    a step is all matmul and a prompt alone: the long-context and mixed shapes are taken below
    that, where they are cheap to time."""
    short, long = min(64, max_model_len // 8), min(512, max_model_len // 2)
    shapes = [((context, 1),) * s for s in seq_buckets for context in (short, long)]
    mixed_seqs = seq_buckets[len(seq_buckets) // 2]  # a middle sequence bucket
    swept = [t for t in token_buckets if t <= 256][-2:]  # mixed steps at every sequence bucket
    for t in token_buckets:
        if t < 2:
            continue
        shapes.append(((0, t),))
        if t > 256:
            continue
        if long + t <= max_model_len:
            shapes.append(((long, t),))  # a later chunk of a long prompt
        for s in seq_buckets if t in swept else (mixed_seqs,):
            decodes = min(s, t) - 1
            if decodes > 0:
                shapes.append(((short, 1),) * decodes + ((0, t - decodes),))
                if t in swept and long + 1 <= max_model_len:  # the decodes' context, told from the chunk's
                    shapes.append(((long, 1),) * decodes + ((0, t - decodes),))
    return list(dict.fromkeys(shapes))


def time_plans(runner, plans: list[StepPlan], budget_s: float, min_rounds: int = 3,
               progress: Callable[[int], None] | None = None) -> list[float]:
    """Median seconds of each plan's step (dispatch, compute, result copy) over rounds taken
    round-robin: at least `min_rounds`, more while `budget_s` lasts (at most 9)."""
    for plan in plans:
        jax.device_get(runner.run_plan(plan))  # the first call of a shape may still load it from the compile cache
    times: list[list[float]] = [[] for _ in plans]
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() - start < budget_s and rounds < 9):
        for i, plan in enumerate(plans):
            begin = time.perf_counter()
            jax.device_get(runner.run_plan(plan))
            times[i].append(time.perf_counter() - begin)
        rounds += 1
        if progress:
            progress(rounds)
    return [statistics.median(t) for t in times]


class _TimedRunner:
    """The runner, timing what the engine waits for in it (dispatch and collect) per step."""

    def __init__(self, runner):
        self._runner = runner
        self.seconds = 0.0
        self.seqs: list[int] = []  # sequences of each dispatched step

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def dispatch(self, plan: StepPlan):
        start = time.perf_counter()
        self.seqs.append(len(plan.request_ids))
        pending = self._runner.dispatch(plan)
        self.seconds += time.perf_counter() - start
        return pending

    def collect(self, pending):
        start = time.perf_counter()
        tokens = self._runner.collect(pending)
        self.seconds += time.perf_counter() - start
        return tokens


def host_seconds(engine, lengths: list[tuple[int, int]]) -> tuple[float, float]:
    """The engine's work beside the runner's, per step and per sequence in the step: a burst of
    requests through the real engine stepping one iteration at a time (each step's wall time less
    what it waited for in the runner), fitted by non-negative least squares. The engine must not
    plan ahead (async scheduling off), so that no host work hides behind a step in flight."""
    from scipy.optimize import nnls

    assert engine.in_flight.depth == 1, "measure the host's work one step at a time"
    timed = _TimedRunner(engine.runner)
    engine.runner = timed
    rows, host = [], []
    try:
        for i, (prompt_len, max_tokens) in enumerate(lengths):
            ids = [1 + (i + j) % (engine.model_config.vocab_size - 1) for j in range(prompt_len)]
            engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished_requests():
            start, waited, steps = time.perf_counter(), timed.seconds, len(timed.seqs)
            engine.step()
            if len(timed.seqs) > steps:
                rows.append([1.0, timed.seqs[-1]])
                host.append(max(0.0, time.perf_counter() - start - (timed.seconds - waited)))
    finally:
        engine.runner = timed._runner
    (per_step, per_seq), _ = nnls(np.array(rows), np.array(host))
    return float(per_step), float(per_seq)


def measure_cost_model(llm, budget_s: float = 30.0, progress: Callable[[str, int, int], None] | None = None
                       ) -> tuple[CostModel, list[Timing]]:
    """The cost model of `llm`'s runner on this machine (its buckets bound the grid), and the timings
    it was fitted to. `budget_s`: seconds for the grid's timing rounds (at least three are taken)."""
    runner = llm.runner
    max_model_len = runner.max_pages_per_seq * runner.page_size
    shapes = grid(runner.buckets.tokens, runner.buckets.seqs, min(max_model_len, llm.engine.max_model_len))
    plans = [chunks_plan(runner, list(chunks)) for chunks in shapes]
    seconds = time_plans(runner, plans, budget_s,
                         progress=(lambda rounds: progress("timing steps", rounds, len(plans))) if progress else None)
    timings = [Timing(chunks, *plan.bucket, s) for chunks, plan, s in zip(shapes, plans, seconds)]
    # The host's share: a burst of max_num_seqs short requests through the engine, finishing one
    # after another so that the steps run every number of sequences.
    max_seqs = runner.buckets.seqs[-1]
    prompt = max(1, min(32, llm.engine.max_model_len // 4))
    longest = max(2, min(24, llm.engine.max_model_len - prompt - 1))
    burst = [(prompt, 2 + i * (longest - 2) // max(1, max_seqs - 1)) for i in range(max_seqs)]
    per_step, per_seq = host_seconds(llm.engine, burst)
    if progress:
        progress("engine burst", 1, 1)
    return fit(timings, per_step, per_seq), timings


# ---- the measuring process: `python -m orca_jax.tuning.measure` ------------------------------

def host_memory() -> int:
    """Physical memory of this host: the CPU device's memory, for the memory plan."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory(runner) -> int | None:
    """Bytes the engine may use on each device: an accelerator's limit as JAX reports it, the host's
    memory on CPU; None when an accelerator reports none."""
    devices = [d for d in runner.stages[0].mesh.devices.flat]
    if devices[0].platform == "cpu":
        return host_memory()
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    return min(limits) if all(limits) else None


def kv_pages(llm, kv_budgets: list[int], memory: int | None) -> dict[int, int | str]:
    """The memory plan's KV pages for each budget, or the reason it refuses the budget. Quantized
    weights are counted at their float size (the plan errs towards refusing)."""
    from orca_jax.config import ConfigError
    from orca_jax.parallel.memory_plan import plan_memory

    config, model = llm.config, llm.engine.model_config
    answers: dict[int, int | str] = {}
    for kv in kv_budgets:
        try:
            plan = plan_memory(model, config.parallel, page_size=config.cache.page_size,
                               max_model_len=llm.engine.max_model_len, device_memory=memory, kv_cache_memory=kv,
                               kv_cache_dtype=config.cache.kv_cache_dtype,
                               memory_utilization=config.cache.device_memory_utilization)
            answers[kv] = plan.num_pages
        except ConfigError as error:
            answers[kv] = str(error)
    return answers


def main(argv: list[str] | None = None) -> None:
    """Builds the engine of --config, measures its cost model and the memory plan of each KV budget,
    and writes them as JSON to --out. The tuner runs this in a process of its own, so that the
    device's memory is free again for the server it starts afterwards."""
    import argparse
    import dataclasses
    import json

    from tqdm.auto import tqdm

    from orca_jax import LLM
    from orca_jax.config import EngineConfig, load_toml

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=30.0)
    parser.add_argument("--kv-cache-memory", type=int, nargs="*", default=[])
    parser.add_argument("--device-memory", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    config = load_toml(EngineConfig, args.config)
    # One step at a time, so the engine's own work can be told from the runner's (host_seconds).
    llm = LLM(config=dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                                 async_scheduling=False)))
    bar = tqdm(desc="measuring step times", unit="round")

    def progress(stage: str, done: int, total: int) -> None:
        bar.set_postfix_str(f"{stage}: {total} shapes" if stage == "timing steps" else stage)
        bar.update(done - bar.n)

    model, timings = measure_cost_model(llm, args.budget_s, progress)
    bar.close()
    memory = args.device_memory or device_memory(llm.runner)
    result = {
        "cost_model": model.to_json(),
        "timings": [{"chunks": t.chunks, "token_bucket": t.token_bucket, "seq_bucket": t.seq_bucket,
                     "seconds": t.seconds} for t in timings],
        "kv_pages": {str(kv): pages for kv, pages in kv_pages(llm, args.kv_cache_memory, memory).items()},
        "device_memory": memory, "platform": llm.runner.stages[0].mesh.devices.flat[0].platform,
        "max_model_len": llm.engine.max_model_len, "page_size": llm.runner.page_size,
        "vocab_size": llm.engine.model_config.vocab_size,
        "special_token_ids": sorted({llm.engine.model_config.bos_token_id, *llm.engine.model_config.eos_token_ids}
                                    - {None}),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
