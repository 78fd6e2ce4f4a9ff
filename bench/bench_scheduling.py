"""Offline scheduling benchmark: request-level (static) vs iteration-level scheduling, measured and
predicted, on the same workloads through every policy.

    python bench/bench_scheduling.py [--workloads zipf uniform equal] [--num-requests 48]
                                     [--max-num-seqs 16] [--max-num-batched-tokens 256]

For each workload (all requests queued at once; each generates exactly max_tokens, ignore_eos) and
each policy (static, orca, paged, chunked; chunked with prefix caching on workloads that share a
prompt prefix), one engine is built on the one shared runner, so every policy runs the same compiled
buckets. Per policy it reports generated tokens/s, wall time, iterations of the engine beside those
of the simulation (orca_jax/tuning/simulate.py), batch occupancy, static's wasted decode slots, latency
percentiles and preemptions.

Prediction. Before the runs, the step time of every compiled (tokens, sequences) shape is measured
here, plus the cost of cached context (orca_jax/tuning/simulate.py, StepTimeModel). The simulated steps of each
policy priced by that model give a predicted wall time; static's predicted wall over each iteration-
level policy's is the throughput ratio the engine should reach, printed beside the achieved ratio.

Latencies: time to first token (TTFT) and time between tokens (TBT) are taken when the engine
produces each token; end-to-end latency when the request's result is released -- for static, when
its whole batch completes, as in the FasterTransformer baseline. Normalised latency is end-to-end
latency over output tokens.

Saves the table as bench/results/scheduling_new.json (or --out; the committed figures are scheduling.json),
and beside it the step-time curves (<name>_step_time.png) and per-workload throughput and latency
(<name>_policies.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine
from stats import percentiles
from workloads import WorkloadSpec, build_workload, describe, named_spec, save_jsonl, workload_lengths

from orca_jax import LLM, SamplingParams
from orca_jax.config import SchedulerConfig
from orca_jax.engine.engine import LLMEngine
from orca_jax.runner.model_runner import RunnerStats
from orca_jax.engine.step_plan import StepPlan
from orca_jax.tuning.measure import chunks_plan, time_plans
from orca_jax.model.paged_attention import PAGES_PER_BLOCK
from orca_jax.tuning.simulate import (
    SimConfig,
    SimResult,
    StepTimeModel,
    ideal_ratio,
    occupancy,
    predicted_wall_s,
    simulate,
)

RESULTS = Path(__file__).resolve().parent / "results"
# name -> (scheduling policy, prefix caching)
VARIANTS = {"static": ("static", False), "orca": ("orca", False), "paged": ("paged", False),
            "chunked": ("chunked", False), "chunked+prefix": ("chunked", True)}
ITERATION_LEVEL = ("orca", "paged", "chunked")


class TimingRunner:
    """The model runner, plus a clock: records when each request's tokens are produced and the
    shape of every step. The engine sees the same runner (same compiled buckets, same KV arrays),
    one step at a time (each step is timed whole, so none overlaps another)."""

    max_in_flight = 1
    feeds_sampled_tokens = False  # each step is timed whole, so none is planned ahead of another

    def __init__(self, runner):
        self.runner = runner
        self.kv_layout = runner.kv_layout
        self.buckets = runner.buckets
        self.token_times: dict[str, list[float]] = defaultdict(list)
        self.steps: list[tuple[int, int, int]] = []  # (tokens, sequences, static padding rows)
        self.step_seconds: list[float] = []  # the runner's time for each step

    def dispatch(self, plan):
        """Runs the step to completion; `collect` hands back its tokens."""
        start = time.perf_counter()
        sampled = self.runner.execute(plan)
        self.step_seconds.append(time.perf_counter() - start)
        now = time.monotonic()
        for request_id in sampled:
            self.token_times[request_id].append(now)
        self.steps.append((plan.num_real_tokens, len(plan.request_ids), plan.num_padding_seqs))
        return sampled

    def collect(self, sampled):
        return sampled


def run_policy(llm: LLM, variant: str, workload, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    policy, prefix_caching = VARIANTS[variant]
    config = dataclasses.replace(
        llm.config,
        cache=dataclasses.replace(llm.config.cache, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens))
    runner = TimingRunner(llm.runner)
    engine = LLMEngine(config, llm.engine.model_config, runner, llm.tokenizer, llm.engine.max_model_len)
    llm.runner.stats = RunnerStats()
    start = time.perf_counter()
    for i, request in enumerate(workload):
        engine.add_request(request.prompt_token_ids,
                           SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True),
                           request_id=str(i))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = (output, time.monotonic())
    wall = time.perf_counter() - start

    ttft, tbt, e2e, normalised, queue = [], [], [], [], []
    for request_id, (output, released) in finished.items():
        times, metrics = runner.token_times[request_id], output.metrics
        assert len(times) == len(output.outputs[0].token_ids) == workload[int(request_id)].max_tokens
        ttft.append(times[0] - metrics.arrival_time)
        tbt += [b - a for a, b in itertools.pairwise(times)]
        e2e.append(released - metrics.arrival_time)
        normalised.append(e2e[-1] / len(times))
        queue.append(metrics.queue_time)
    stats = llm.runner.stats
    steps = runner.steps
    decode_rows = sum(seqs + padding for tokens, seqs, padding in steps if tokens == seqs)
    return {
        "policy": variant,
        "generated_tokens": engine.num_generated_tokens,
        "wall_s": wall,
        "tokens_per_s": engine.num_generated_tokens / wall,
        "steps": engine.num_steps,
        "mean_seqs_per_step": sum(s for _, s, _ in steps) / len(steps),
        "mean_occupancy": sum(s for _, s, _ in steps) / len(steps) / max_num_seqs,
        "mean_tokens_per_step": stats.real_tokens / stats.steps,
        "wasted_decode_slots": sum(p for _, _, p in steps),
        "wasted_decode_slot_fraction": sum(p for _, _, p in steps) / decode_rows if decode_rows else 0.0,
        "bucket_padding_fraction": 1 - stats.real_tokens / stats.padded_tokens,
        "host_ms_per_step": 1000 * (engine.step_time_s - stats.device_s) / stats.steps,
        "device_ms_per_step": 1000 * stats.device_s / stats.steps,
        "preemptions": engine.scheduler.num_preemptions,
        "prefix_cache_hit_tokens": engine.kv.prefix_cache_hits,
        "ttft_s": percentiles(ttft),
        "tbt_s": percentiles(tbt),
        "e2e_latency_s": percentiles(e2e),
        "normalised_latency_s_per_token": percentiles(normalised),
        "queue_s": percentiles(queue),
        "normalised_latencies": sorted(normalised),  # for the CDF plot; dropped from the JSON
        "step_shapes_and_seconds": list(zip(steps, runner.step_seconds)),  # for the model check; dropped too
    }


# ---- step time vs batch shape, measured on this machine --------------------------------------

def step_plan(runner, num_tokens: int, num_seqs: int, context: int) -> StepPlan:
    """Arrays of a step of `num_seqs` sequences sharing `num_tokens` new tokens, each with `context`
    tokens already cached, laid out and padded to its bucket as the runner does for a real step."""
    if context + -(-num_tokens // num_seqs) > runner.max_pages_per_seq * runner.page_size:
        raise ValueError(f"a context of {context} tokens exceeds the model's length; lower --contexts")
    return chunks_plan(runner, [(context, num_tokens // num_seqs + (row < num_tokens % num_seqs))
                                for row in range(num_seqs)])


def measure_step_times(runner, max_num_seqs: int, contexts: tuple[int, ...]) -> tuple[StepTimeModel, dict]:
    """The step-time model: every bucket with nothing cached, and decode steps at batch 1, 2, 4, ...,
    max_num_seqs over each cached context, whose excess over their bucket's base fits the cost of one
    context block per row (least squares through the origin)."""
    buckets = runner.buckets
    batch_sizes, size = [], 1
    while size < max_num_seqs:
        batch_sizes.append(size)
        size *= 2
    batch_sizes.append(max_num_seqs)
    pairs = buckets.pairs()
    decodes = [(c, b) for c in contexts for b in batch_sizes]
    shapes = [(t, s, 0) for t, s in pairs] + [(b, b, c) for c, b in decodes]
    # The median of 5 rounds taken round-robin over the shapes (as `orca-jax tune` times its grid).
    seconds = time_plans(runner, [step_plan(runner, *shape) for shape in shapes], budget_s=0, min_rounds=5)
    base = dict(zip(pairs, seconds))
    block_tokens = PAGES_PER_BLOCK * runner.page_size
    points = []  # (context, measured seconds, bucket base seconds, rows x context blocks)
    for (context, batch), measured in zip(decodes, seconds[len(pairs):]):
        t, s = buckets.pick(batch, batch)
        blocks = min(s, t) * -(-context // block_tokens)  # the decode row group: S_bucket rows
        points.append((context, measured, base[(t, s)], blocks))
    xs = [x for *_, x in points]
    ys = [measured - base_s for _, measured, base_s, _ in points]
    per_row_block = max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)) if any(xs) else 0.0
    model = StepTimeModel(list(buckets.tokens), list(buckets.seqs), base, block_tokens, per_row_block)
    curves = {
        "decode_batch_sizes": batch_sizes,
        "decode_ms": {str(c): [1000 * p[1] for p in points if p[0] == c] for c in contexts},
        "decode_model_ms": {str(c): [1000 * (p[2] + per_row_block * p[3]) for p in points if p[0] == c]
                            for c in contexts},
        "prefill_tokens": list(buckets.tokens),
        "prefill_ms": [1000 * base[buckets.pick(t, 1)] for t in buckets.tokens],
    }
    return model, curves


# ---- plots -------------------------------------------------------------------------------

def plot_step_times(curves: dict, model_name: str, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (decode_ax, prefill_ax) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    for context, ms in curves["decode_ms"].items():
        line, = decode_ax.plot(curves["decode_batch_sizes"], ms, "o-", label=f"measured, {context} cached")
        decode_ax.plot(curves["decode_batch_sizes"], curves["decode_model_ms"][context], "x--", color=line.get_color(),
                       label=f"model, {context} cached")
    decode_ax.set(xscale="log", xlabel="decode batch size (sequences)", ylabel="step time (ms)",
                  title="decode step", ylim=(0, None))
    decode_ax.set_xticks(curves["decode_batch_sizes"], [str(b) for b in curves["decode_batch_sizes"]])
    decode_ax.legend(fontsize=7)
    prefill_ax.plot(curves["prefill_tokens"], curves["prefill_ms"], "o-")
    prefill_ax.set(xscale="log", xlabel="tokens in the step (nothing cached)", ylabel="step time (ms)",
                   title="prefill step", ylim=(0, None))
    prefill_ax.set_xticks(curves["prefill_tokens"], [str(t) for t in curves["prefill_tokens"]])
    for ax in (decode_ax, prefill_ax):
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.suptitle(f"{model_name} on {jax.default_backend()}: step time vs batch (bucket-padded)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_policies(workloads: list[dict], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(workloads), 2, figsize=(9, 2.8 * len(workloads)), dpi=80, squeeze=False)
    for (bars, cdf), w in zip(axes, workloads):
        rows = w["policies"]
        names = [r["policy"] for r in rows]
        x = np.arange(len(rows))
        bars.bar(x - 0.2, [r["tokens_per_s"] for r in rows], 0.4, label="measured")
        bars.bar(x + 0.2, [r["predicted_tokens_per_s"] or 0 for r in rows], 0.4, label="predicted")
        bars.set_xticks(x, names, fontsize=8)
        bars.set(ylabel="generated tokens/s", title=f"{w['kind']}: throughput")
        bars.legend(fontsize=7)
        for r in rows:
            values = r["normalised_latencies"]
            cdf.plot(values, np.arange(1, len(values) + 1) / len(values), label=r["policy"])
        cdf.set(xscale="log", xlabel="normalised latency (s / output token)", ylabel="fraction of requests",
                title=f"{w['kind']}: latency CDF")
        cdf.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        cdf.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- the run -----------------------------------------------------------------------------

def add_prediction(row: dict, sim: SimResult | None, model: StepTimeModel) -> dict:
    """Adds the simulation's iterations and the wall time and tokens/s it predicts to a measured row,
    and, per bucket, the runner's measured time against the model's over the same steps (the
    simulation's steps are the engine's, one for one, so each measured step has its prediction)."""
    measured = row.pop("step_shapes_and_seconds")
    row["per_bucket"] = None
    if sim and [(s.num_tokens, s.num_seqs, s.num_padding_seqs) for s in sim.steps] == [m[0] for m in measured]:
        per_bucket = defaultdict(lambda: [0, 0.0, 0.0])
        for step, (_, seconds) in zip(sim.steps, measured):
            t, s = model.bucket(step.padded_num_tokens, step.padded_num_seqs)
            entry = per_bucket[f"{t}x{s}"]
            entry[0] += 1
            entry[1] += seconds
            entry[2] += model.step_seconds(step)
        row["per_bucket"] = {b: {"steps": n, "measured_s": m, "model_s": p} for b, (n, m, p) in sorted(per_bucket.items())}
    row["simulated_steps"] = sim.num_steps if sim else None
    row["simulated_preemptions"] = sim.num_preemptions if sim else None
    row["predicted_wall_s"] = predicted_wall_s(sim, model) if sim else None
    row["predicted_tokens_per_s"] = row["generated_tokens"] / row["predicted_wall_s"] if sim else None
    row["simulated_occupancy"] = occupancy(sim) if sim else None
    return row


def simulated(lengths, variant: str, args, runner) -> SimResult | None:
    """The simulation of a variant, or None for prefix caching (not modelled: hits depend on content)."""
    policy, prefix_caching = VARIANTS[variant]
    if prefix_caching:
        return None
    return simulate(lengths, SimConfig(policy, args.max_num_seqs, args.max_num_batched_tokens, runner.page_size,
                                       runner.num_pages))


def workload_spec(kind: str, args) -> WorkloadSpec:
    overrides = {"shared_prefix": args.shared_prefix}
    if args.prompt_len:
        overrides["prompt_len"] = tuple(args.prompt_len)
    if args.output_len:
        overrides["output_len"] = tuple(args.output_len)
    return named_spec(kind, args.num_requests, args.seed, **overrides)


def bench_workload(llm: LLM, kind: str, spec: WorkloadSpec, model: StepTimeModel, args) -> dict:
    workload = build_workload(llm.tokenizer, spec)
    if args.save_workloads:
        save_jsonl(workload, args.save_workloads / f"{kind}.jsonl")
    lengths = workload_lengths(workload)
    variants = [v for v in args.policies if v != "chunked+prefix" or spec.shared_prefix > 0]
    print(f"\n== {kind}: {describe(lengths)}; max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}", flush=True)
    if "chunked+prefix" in args.policies and "chunked+prefix" not in variants:
        print("chunked+prefix skipped: the prompts share no prefix, so prefix caching changes nothing "
              "(give --shared-prefix N)")
    ideal = ideal_ratio(lengths, args.max_num_seqs, args.max_num_batched_tokens)
    rows = []
    for variant in variants:
        sim = simulated(lengths, variant, args, llm.runner)
        row = add_prediction(run_policy(llm, variant, workload, args.max_num_seqs, args.max_num_batched_tokens),
                             sim, model)
        rows.append(row)
        predicted = row["predicted_tokens_per_s"]
        predicted = "     -" if predicted is None else f"{predicted:6.1f}"  # prefix hits are not modelled
        print(f"{variant:15s} {row['tokens_per_s']:6.1f} tok/s (pred {predicted})  "
              f"{row['wall_s']:6.1f} s  steps {row['steps']:4d} (sim {row['simulated_steps'] or '-':>4})  "
              f"occupancy {row['mean_occupancy']:4.0%}  wasted slots {row['wasted_decode_slot_fraction']:4.0%}  "
              f"TTFT p50 {row['ttft_s']['p50']:5.2f} s  TBT p50 {1000 * row['tbt_s']['p50']:5.0f} ms  "
              f"norm lat p50/p99 {row['normalised_latency_s_per_token']['p50']:.2f}/"
              f"{row['normalised_latency_s_per_token']['p99']:.2f} s/tok  preempt {row['preemptions']}", flush=True)
    by_name = {r["policy"]: r for r in rows}
    ratios = {}
    if "static" in by_name:
        static = by_name["static"]
        for name in ITERATION_LEVEL:
            if name not in by_name:
                continue
            r = by_name[name]
            achieved = r["tokens_per_s"] / static["tokens_per_s"]
            predicted = static["predicted_wall_s"] / r["predicted_wall_s"]
            ratios[name] = {"achieved": achieved, "predicted": predicted, "achieved_over_predicted": achieved / predicted}
            print(f"{name} / static throughput: achieved {achieved:.3f}, predicted {predicted:.3f} "
                  f"(achieved/predicted {achieved / predicted:.1%}); ideal step ratio {ideal['step_ratio']:.3f} "
                  f"({ideal['static_steps']} vs {ideal['orca_steps']} steps)")
    return {"kind": kind, "spec": dataclasses.asdict(spec), "workload": describe(lengths), "ideal": ideal,
            "ratios_vs_static": ratios, "policies": rows}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workloads", nargs="+", default=["zipf", "uniform", "equal"],
                        choices=["zipf", "uniform", "equal"])
    parser.add_argument("--policies", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="chunked+prefix runs only on workloads with --shared-prefix > 0")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens every prompt starts with (a system prompt), for prefix caching")
    parser.add_argument("--prompt-len", type=int, nargs=2, metavar=("LO", "HI"),
                        help="prompt length range for every kind, instead of its own (equal: HI)")
    parser.add_argument("--output-len", type=int, nargs=2, metavar=("LO", "HI"),
                        help="output length range for every kind, instead of its own (equal: HI)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 384],
                        help="cached tokens per sequence for the decode step-time curves")
    parser.add_argument("--out", type=Path, default=RESULTS / "scheduling_new.json",
                        help="results JSON; the plots go beside it as <name>_step_time.png, <name>_policies.png")
    parser.add_argument("--save-workloads", type=Path, default=None, help="folder to save each workload as JSONL")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:  # bad workload settings fail here, before minutes of loading and compiling
        specs = {kind: workload_spec(kind, args) for kind in args.workloads}
    except ValueError as error:
        sys.exit(f"error: {error}")
    llm = LLM(args.model, scheduling_policy="chunked", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    llm.runner.run_first_runs()  # every program's slow first run, before the timing (a server's idle thread does it)
    print("measuring step times ...", file=sys.stderr, flush=True)
    model, curves = measure_step_times(llm.runner, args.max_num_seqs, tuple(args.contexts))
    workloads = [bench_workload(llm, kind, spec, model, args) for kind, spec in specs.items()]

    results = {"machine": machine.describe(), "model": args.model, "backend": jax.default_backend(), "jax": jax.__version__,
               "num_requests": args.num_requests, "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens, "page_size": llm.runner.page_size,
               "num_kv_pages": llm.runner.num_pages, "step_time_model": model.to_json(), "step_time_curves": curves,
               "workloads": workloads, "compilations_after_warmup": llm.num_compilations_after_warmup}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plots = [args.out.with_name(f"{args.out.stem}_{name}.png") for name in ("step_time", "policies")]
    plot_step_times(curves, args.model, plots[0])
    plot_policies(workloads, plots[1])
    for w in workloads:
        for row in w["policies"]:
            del row["normalised_latencies"]
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nsaved {args.out}, {plots[0].name}, {plots[1].name}; compilations after warm-up: "
          f"{llm.num_compilations_after_warmup}")
    return results


if __name__ == "__main__":
    main()
