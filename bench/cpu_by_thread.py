"""Where the CPU goes while requests decode: each thread's CPU time and run-queue wait per generated
token, grouped by thread (the Python main thread, XLA's execution threads, its Eigen pool), read from
/proc/self/task/*/schedstat (Linux) around a greedy generation of `--seqs` requests of `--tokens`
tokens each, after a warm-up generation.

    python bench/cpu_by_thread.py [--model smollm2-135m-instruct] [--quantization gguf] [--seqs 1] [--tokens 256]

A thread's wait is the time it was ready to run but had no core. On a 2-core machine the engine's
threads outnumber the cores, so a decode step is bound by the CPU work of all of them together, not
only by the device program's critical path: CPU taken from any thread (the host's dispatch, the
pool's spinning, a kernel) is time given back to the others. The kernels' own share is inside the
execution and pool threads; `perf record -p PID` splits those further.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages
import machine  # noqa: E402 (bench/, the script's own folder)
from orca_jax import LLM, SamplingParams  # noqa: E402
from orca_jax.config import DEFAULT_MODEL, QUANTIZATION_CHOICES  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 5


def threads() -> dict[int, tuple[str, int, int]]:
    """tid -> (name, ns run, ns waited on the run queue) for each thread of this process."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            run, wait, _ = (int(field) for field in (task / "schedstat").read_text().split())
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        out[int(task.name)] = ("python (main)" if int(task.name) == os.getpid() else name, run, wait)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="gguf")
    parser.add_argument("--seqs", type=int, default=1, help="requests decoding together")
    parser.add_argument("--tokens", type=int, default=256, help="greedy tokens per request")
    args = parser.parse_args()
    if not Path("/proc/self/task").is_dir():
        sys.exit("cpu_by_thread.py reads /proc/self/task: Linux only")
    llm = LLM(args.model, quantization=args.quantization, max_num_seqs=max(args.seqs, 1), show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([PROMPT] * args.seqs, params, use_tqdm=False)  # warm: every program of these steps has run
    before, start = threads(), time.perf_counter()
    outputs = llm.generate([PROMPT] * args.seqs, params, use_tqdm=False)
    wall, after = time.perf_counter() - start, threads()
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)

    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])  # threads, ns run, ns waited
    for tid, (name, run, wait) in after.items():
        _, run0, wait0 = before.get(tid, (name, 0, 0))
        if run - run0 > 0:
            group = groups[name]
            group[0] += 1
            group[1] += run - run0
            group[2] += wait - wait0
    print(f"{machine.cpu_name()}, {os.cpu_count()} cores; {args.model}, {args.quantization}, {args.seqs} request(s) x "
          f"{args.tokens} tokens: {tokens} tokens in {wall:.2f} s, {1000 * wall / tokens:.2f} ms a token (prefill included)")
    print(f"{'threads':<24}{'n':>3}  {'CPU ms/token':>12}  {'waited ms/token':>15}")
    for name, (count, run, wait) in sorted(groups.items(), key=lambda item: -item[1][1]):
        print(f"{name:<24}{count:>3}  {run / 1e6 / tokens:12.3f}  {wait / 1e6 / tokens:15.3f}")
    total_run, total_wait = (sum(group[i] for group in groups.values()) for i in (1, 2))
    print(f"{'all':<24}{sum(g[0] for g in groups.values()):>3}  {total_run / 1e6 / tokens:12.3f}  "
          f"{total_wait / 1e6 / tokens:15.3f}   (cores busy {total_run / 1e9 / wall:.2f} of {os.cpu_count()})")


if __name__ == "__main__":
    main()
