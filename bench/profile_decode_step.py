"""Where a decode step's time goes: the layers and head programs per part (native matmul calls,
attention, KV writes, XLA's fusions), from XLA:CPU's per-thunk trace, and the host's share (packing
the step's arrays, the two program calls' dispatch), for `--seqs` sequences decoding together.

    python bench/profile_decode_step.py [--model smollm2-135m-instruct] [--quantization gguf] [--seqs 1]
                                        [--steps 20] [--kv-cache-dtype auto] [--prefill]

It records one real decode step's plan from a generation (`--prefill`: its first step, the prompts'
first chunk), replays it `--steps` times under
jax.profiler (perfetto trace in a temporary folder), names each thunk by the compiled program's HLO
(custom-call targets; a matmul call by the row counts of its matrices: "576+192+192" is one call of
q, k and v) and prints ms per step per part, then times the host side of the same step. Timings on a
shared machine move with its load (printed): compare parts within one run.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages
import machine  # noqa: E402 (bench/, the script's own folder)
from orca_jax import LLM, SamplingParams  # noqa: E402
from orca_jax.config import DEFAULT_MODEL, KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 5
NUMBERED = re.compile(r"[.]\d+$")  # an op's number: fusions of one kind summed together
CALL = re.compile(r'\s*(?:ROOT )?%?(\S+) = .*? custom-call\(.*?custom_call_target="(\w+)"(.*)')


def part_names(hlo: str) -> dict[str, str]:
    """HLO op name -> part, for the program's custom calls."""
    parts = {}
    for line in hlo.splitlines():
        match = CALL.match(line)
        if match:
            name, target, rest = match.groups()
            # The matmul's operands: x, num_rows, then (weights, scales) per matrix.
            operands = re.findall(r"\w+\[([\d,]*)\]", rest.split("operand_layout_constraints={")[-1].split("}, api_version")[0])
            rows = [shape.split(",")[0] for shape in operands[2::2]]
            parts[name] = f"matmul {'+'.join(rows)}" if target == "orca_quantized_matmul" else target
    return parts


def recorded_plan(llm: LLM, seqs: int, prefill: bool = False):
    """The plan of one decode step of `seqs` sequences (`prefill`: the generation's first step, its
    prompts' first chunk), from a real generation."""
    runner, plans = llm.runner, []
    dispatch = runner.run_plan

    def record(plan):
        if not plans and (prefill or (plan.bucket[1] == seqs and len(plan.token_ids) == seqs)):
            plans.append(plan)
        return dispatch(plan)

    runner.run_plan = record
    llm.generate([f"{i}: {PROMPT}" for i in range(seqs)], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                 use_tqdm=False)
    runner.run_plan = dispatch
    return plans[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="gguf")
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prefill", action="store_true",
                        help="profile the first step instead: the prompts' prefill (up to the token budget)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto",
                        help="KV pages' dtype (as the server's flag)")
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=max(32, args.seqs), quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, show_progress=False)
    runner = llm.runner
    plan = recorded_plan(llm, args.seqs, args.prefill)
    stage = runner.stages[0]
    layers = runner.programs.get(stage, "layers", plan.bucket[0])
    head = runner.programs.get(stage, "head", plan.bucket[1])

    def step():
        """The step as the runner runs it; returns (pack s, layers call s, head call s, whole s)."""
        start = time.perf_counter()
        inputs = runner.layers_inputs(plan)
        packed = time.perf_counter()
        x, stage.kv_cache, stage.token_pages = layers(stage.param_leaves, stage.kv_cache, stage.token_pages, None,
                                                       inputs, stage.fed_tokens)
        called = time.perf_counter()
        sampling, speculation = runner.head_inputs.sampling(plan, stage.replicated), runner.head_inputs.speculation(plan)
        packed_head = time.perf_counter()
        out, _ = head(stage.head_param_leaves, x, sampling, speculation, stage.token_pages, None)
        headed = time.perf_counter()
        jax.block_until_ready(out)
        return (packed - start) + (packed_head - called), called - packed, headed - packed_head, time.perf_counter() - start

    for _ in range(5):
        step()
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        for _ in range(args.steps):
            step()
        jax.profiler.stop_trace()
        trace = json.load(gzip.open(glob.glob(f"{folder}/plugins/profile/*/perfetto_trace.json.gz")[0]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {"layers": part_names(layers.as_text()), "head": part_names(head.as_text())}
    totals = collections.defaultdict(collections.Counter)
    for event in events:
        op = (event.get("args") or {}).get("hlo_op")
        if event.get("ph") == "X" and op:
            program = "head" if "head" in event["args"]["hlo_module"] else "layers"
            part = names[program].get(op) or "XLA " + NUMBERED.sub("", op)  # a fusion by its kind
            totals[program][part] += event["dur"] / 1000 / args.steps
    print(f"{machine.cpu_name()}, native kernels {machine.native_isa()}; {args.model}, {args.quantization}, "
          f"{args.seqs} sequence(s), bucket {plan.bucket}; load average {os.getloadavg()[0]:.1f}; ms per step:")
    for program, parts in totals.items():
        print(f"  {program} program: thunks {sum(parts.values()):.3f} ms")
        xla = sum(ms for part, ms in parts.items() if part.startswith("XLA"))
        print(f"    {xla:8.3f}  XLA's fusions and ops, all together; the largest parts:")
        for part, ms in parts.most_common(10):
            print(f"    {ms:8.3f}  {part}")
    timings = list(zip(*(step() for _ in range(100))))
    pack, layers_call, head_call, whole = (1000 * statistics.median(t) for t in timings)
    print(f"  host: packing {pack:.3f} ms, layers call returns after {layers_call:.3f} ms "
          f"({len(stage.param_leaves) + len(jax.tree.leaves(stage.kv_cache))} parameter and KV arrays), "
          f"head call {head_call:.3f} ms; the step, dispatched and waited for: {whole:.3f} ms")


if __name__ == "__main__":
    main()
