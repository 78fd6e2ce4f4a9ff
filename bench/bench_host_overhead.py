"""The engine's host work per decode step, by batch size: the Python side of a step (scheduling,
building the plan, dispatching, taking the tokens back, stop checks and outputs) on the tiny model,
whose device work is next to nothing, so a step's time is its host work. A GPU step must hide this
behind the device's work (async scheduling): at 256 requests it was longer than a whole decode step
of an 8B model on an H200 would be.

    python bench/bench_host_overhead.py [--batch-sizes 1 16 64 256] [--tokens 100] [--profile 256]

Per batch size B: B greedy requests of `--tokens` tokens each, queued at once and run to the end by
`LLMEngine.step` (after one warm round), printing the main thread's CPU time per step (the host
work; on this shared machine the figure moves less than wall time) and wall time per step: with an
output for every request every step (the server's loop, which streams them), and with the finished
requests' outputs only (the offline `LLM`'s).
`--profile B` prints cProfile's top functions for that batch size. Saves the table as
bench/results/host_overhead_new.json (or --out).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages
import machine  # noqa: E402 (bench/, the script's own folder)
from orca_jax import LLM, SamplingParams  # noqa: E402
from orca_jax.runner.builder import freeze_start_up_objects  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def run(llm: LLM, batch: int, tokens: int, finished_only: bool = False) -> tuple[int, float, float]:
    """(steps, wall s, main-thread CPU s) of one round of `batch` requests."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request([engine.model_config.bos_token_id, 1 + i % 50, 2, 3], params)
    steps, wall, cpu = 0, time.perf_counter(), time.thread_time()
    while engine.has_unfinished_requests():
        engine.step(finished_only)
        steps += 1
    return steps, time.perf_counter() - wall, time.thread_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--tokens", type=int, default=100, help="greedy tokens per request (the tiny model: <= 120)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per batch size; the best is printed")
    parser.add_argument("--profile", type=int, metavar="B", help="also print cProfile's top functions at this batch size")
    parser.add_argument("--sort", default="tottime", help="the profile's order: tottime or cumulative")
    parser.add_argument("--out", type=Path, default=RESULTS / "host_overhead_new.json")
    args = parser.parse_args()
    llm = LLM("tiny", max_num_seqs=max(args.batch_sizes), show_progress=False)
    freeze_start_up_objects()  # as `orca-jax serve` does (LLM does not): the collector's share as served
    print(f"{machine.cpu_name()}; the tiny model; {args.tokens} tokens per request; per decode step, best of "
          f"{args.rounds} rounds:")
    print(f"{'B':>5}  {'steps':>5}  {'host CPU ms':>11}  {'wall ms':>8}  {'us per request':>14}  "
          f"{'finished only: CPU ms':>21}")
    rows = []
    for batch in args.batch_sizes:
        run(llm, batch, args.tokens)  # warm: every bucket of these steps has run
        best = {}
        for finished_only in (False, True):
            results = [run(llm, batch, args.tokens, finished_only) for _ in range(args.rounds)]
            best[finished_only] = min(results, key=lambda r: r[2])
        steps, wall, cpu = best[False]
        print(f"{batch:>5}  {steps:>5}  {1000 * cpu / steps:>11.3f}  {1000 * wall / steps:>8.3f}  "
              f"{1e6 * cpu / steps / batch:>14.1f}  {1000 * best[True][2] / best[True][0]:>21.3f}")
        rows.append({"batch": batch, "steps": steps, "host_cpu_ms": 1000 * cpu / steps, "wall_ms": 1000 * wall / steps,
                     "finished_only_host_cpu_ms": 1000 * best[True][2] / best[True][0]})
    args.out.write_text(json.dumps({"machine": machine.describe(), "model": "tiny", "tokens": args.tokens,
                                    "rows": rows}, indent=1) + "\n")
    print(f"saved {args.out}")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        run(llm, args.profile, args.tokens)
        profile.disable()
        pstats.Stats(profile).sort_stats(args.sort).print_stats(30)


if __name__ == "__main__":
    main()
