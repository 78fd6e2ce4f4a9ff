"""One workload over several tensor x pipeline layouts: throughput, step time per stage, batches in
flight and the pipeline bubble.

    python bench/bench_parallel.py [--layouts 1x1 3x1 1x2 3x2] [--num-requests 32]
    orca-jax bench parallel --layouts 1x1 1x2 2x1 2x2 4x2    # on a multi-GPU machine, unchanged

`TPxPP` per layout. On a CPU-only machine the script makes as many CPU devices as the largest layout
needs; they share the machine's cores, so the CPU figures show overheads (transfers between stages,
collectives, per-stage dispatch) and that every layout works, not a speed-up: two stages on two
cores each get about one core, and tp splits matmuls that were already using both cores. On GPUs
each device is real and the same figures show the scaling.

Per layout it reports:
- tokens/s over the workload (greedy, ignore_eos, all requests queued at once);
- step time of each stage, measured alone (block_until_ready) on the most common bucket;
- iterations in flight: how often the engine had 1, 2, ... steps dispatched (max = pipeline depth);
- bubble: the fraction of the run a stage sat idle, 1 - (its busy time / wall time), where its busy
  time adds up its alone-measured time over the buckets of every step it ran. The stage times are
  measured on padding steps (no cached context, so attention is cheaper than in the run): the busy
  time is a lower bound and the bubble an upper bound.
Saves a JSON and a plot beside it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from orca_jax.sizes import byte_size  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_layout(text: str) -> tuple[int, int]:
    try:
        tp, pp = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout {text!r} is not TPxPP, e.g. 3x2") from None
    return tp, pp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--layouts", nargs="+", type=parse_layout, default=[(1, 1), (3, 1), (1, 2), (3, 2)])
    parser.add_argument("--policy", default="chunked")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024, help="capped at the model's context length")
    parser.add_argument("--kv-cache-memory", type=byte_size, default=256 << 20,
                        help="KV cache of the whole layout, split over its devices")
    parser.add_argument("--out", type=Path, default=RESULTS / "parallel_new.json",
                        help="results file (the committed figures are in parallel.json)")
    args = parser.parse_args()

    import jax

    # Only the CPU backend reads this; it must be set before any backend starts.
    jax.config.update("jax_num_cpu_devices", max(tp * pp for tp, pp in args.layouts))
    from workloads import WorkloadSpec, sample_lengths

    from orca_jax import LLM
    from orca_jax.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from orca_jax.parallel.plan_cli import resolve_model_config

    max_model_len = min(args.max_model_len, resolve_model_config(args.model).max_position)

    platform = jax.devices()[0].platform
    print(f"{len(jax.devices())} {platform} device(s); layouts {[f'{tp}x{pp}' for tp, pp in args.layouts]}",
          file=sys.stderr)
    results = []
    for tp, pp in args.layouts:
        config = EngineConfig(
            model=args.model, max_model_len=max_model_len,
            cache=CacheConfig(kv_cache_memory=args.kv_cache_memory // (tp * pp)),
            scheduler=SchedulerConfig(policy=args.policy, max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens),
            parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))
        llm = LLM(config=config, show_progress=False)
        llm.runner.run_first_runs()  # every program's slow first run, before the timing (a server's idle thread does it)
        lengths = sample_lengths(WorkloadSpec(args.num_requests, "uniform", tuple(args.prompt_len), "uniform",
                                              tuple(args.output_len), seed=0))
        result = run_layout(llm, lengths)
        result.update(tp=tp, pp=pp, platform=platform)
        results.append(result)
        stage_ms = ", ".join(f"{ms:.1f}" for ms in result["stage_ms"])
        print(f"tp {tp} x pp {pp}: {result['tokens_per_s']:.1f} tok/s, stage ms [{stage_ms}] at bucket "
              f"{result['common_bucket']}, in flight {result['in_flight_depths']}, bubble "
              f"{', '.join(f'{b:.0%}' for b in result['bubble'])}")
        del llm
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine.describe(), "model": args.model, "policy": args.policy, "num_requests": args.num_requests,
                                    "devices": f"{len(jax.devices())} {platform}", "layouts": results}, indent=1))
    plot(results, args.out.with_suffix(".png"))
    print(f"saved {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)


def run_layout(llm, lengths: list[tuple[int, int]]) -> dict:
    """Runs the workload once ((prompt, output) lengths; the prompts are seeded random ids: with
    ignore_eos their content does not change the work); the buckets of the steps are recorded to
    weigh the stage times."""
    import numpy as np

    from orca_jax.sampling_params import SamplingParams

    engine, runner = llm.engine, llm.runner
    buckets = collections.Counter()
    dispatch = runner.dispatch

    def recording_dispatch(out):
        pending = dispatch(out)
        buckets[pending.plan.bucket] += 1
        return pending

    runner.dispatch = recording_dispatch
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for prompt_len, output_len in lengths:
        engine.add_request(rng.integers(0, runner.config.vocab_size, prompt_len).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - start
    runner.dispatch = dispatch
    stage_seconds = {bucket: stage_times(runner, *bucket) for bucket in buckets}
    busy = [sum(count * stage_seconds[bucket][s] for bucket, count in buckets.items())
            for s in range(len(runner.stages))]
    common = buckets.most_common(1)[0][0]
    return {
        "tokens_per_s": engine.num_generated_tokens / wall,
        "wall_s": wall,
        "steps": engine.num_steps,
        "in_flight_depths": dict(sorted(engine.in_flight.depths.items())),
        "common_bucket": list(common),
        "stage_ms": [1000 * t for t in stage_seconds[common]],
        "bubble": [max(0.0, 1 - b / wall) for b in busy],
        "compilations_after_warmup": runner.num_compilations_after_warmup,
    }


def stage_times(runner, num_tokens: int, num_seqs: int, rounds: int = 3) -> list[float]:
    """Each stage's program alone on a padding step of this bucket: the best of `rounds` runs."""
    import jax
    import numpy as np

    from orca_jax.engine.step_plan import padding_plan

    plan = padding_plan(num_tokens, num_seqs, runner.kv_layout, runner.config.vocab_size)
    plan.num_real_tokens, plan.sampling.num_real_rows = num_tokens, np.int32(num_seqs)  # a full bucket
    times, x = [], None
    for stage in runner.stages:
        if x is not None:
            x = jax.device_put(x, stage.replicated)
        best = float("inf")
        for _ in range(rounds):
            jax.block_until_ready(x)
            begin = time.perf_counter()
            out = runner.run_stage(stage, plan, x)
            jax.block_until_ready(out)
            best = min(best, time.perf_counter() - begin)
        times.append(best)
        x = out
    return times


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"tp{r['tp']}xpp{r['pp']}" for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [r["tokens_per_s"] for r in results], color="tab:blue")
    left.set_ylabel("generated tokens / s")
    left.set_title(f"throughput ({results[0]['platform']})")
    for i, r in enumerate(results):
        for s, bubble in enumerate(r["bubble"]):
            right.bar(i + 0.8 * s / max(1, len(r["bubble"])) - 0.2, bubble, width=0.8 / max(1, len(r["bubble"])),
                      color=f"C{s}", label=f"stage {s}" if i == len(results) - 1 or s >= 1 else None)
    right.set_xticks(range(len(names)), names)
    right.set_ylim(0, 1)
    right.set_ylabel("idle fraction of the run")
    right.set_title("pipeline bubble per stage")
    handles, labels = right.get_legend_handles_labels()
    right.legend(dict(zip(labels, handles)).values(), dict(zip(labels, handles)).keys())
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
