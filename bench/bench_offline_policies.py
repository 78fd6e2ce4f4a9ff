"""Orca's comparison as a user of the offline API runs it: one `LLM` per policy, one warm-up
`generate`, then the timed job, through public calls only.

    python bench/bench_offline_policies.py [--model smollm2-135m-instruct] [--num-requests 32]
                                           [--max-num-seqs 8] [--policies static orca]

Two workloads, all requests queued at once and each generating exactly its max_tokens (ignore_eos):
prompts of 8-32 tokens with heavy-tailed outputs (bounded Pareto, 4-160 tokens, exponent 0.3), and
equal lengths (20-token prompts, 64 outputs). Per policy: seconds to build
the `LLM`, the timed job's wall time and engine steps; per workload: each policy's speed over
`static`'s beside the ideal ratio the iteration counts give (static's steps over the policy's), and
the share of the ideal reached. Nothing is run before the timed job that a user would not run (no
`run_first_runs`): what a program's first run costs inside the job shows here.

Saves bench/results/offline_policies_new.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from workloads import WorkloadSpec, build_workload, describe, workload_lengths  # noqa: E402

from orca_jax import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = {  # short prompts, so that decoding (where the policies differ) dominates
    "pareto": dict(prompt_len=(8, 32), output_dist="zipf", output_len=(4, 160), zipf_alpha=0.3),
    "equal": dict(prompt_dist="equal", prompt_len=(20, 20), output_dist="equal", output_len=(64, 64)),
}


def run_policy(args, policy: str, warmup, requests) -> dict:
    start = time.perf_counter()
    llm = LLM(args.model, scheduling_policy=policy, max_num_seqs=args.max_num_seqs, show_progress=False)
    built_s = time.perf_counter() - start
    params = lambda r: SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)  # noqa: E731
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in warmup], [params(r) for r in warmup],
                 use_tqdm=False)
    steps_before = llm.engine.num_steps
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                           [params(r) for r in requests], use_tqdm=False)
    wall_s = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = {"policy": policy, "build_s": round(built_s, 2), "wall_s": round(wall_s, 3),
           "steps": llm.engine.num_steps - steps_before, "tokens": tokens, "tok_s": round(tokens / wall_s, 1),
           "compilations_after_warmup": llm.num_compilations_after_warmup}
    llm.close()
    print(f"  {policy:8s} built in {built_s:5.1f} s, job {wall_s:6.2f} s, {row['steps']} steps, "
          f"{row['tok_s']} tok/s", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--policies", nargs="+", default=["static", "orca"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=RESULTS / "offline_policies_new.json")
    args = parser.parse_args(argv)

    from orca_jax.runner.builder import model_tokenizer

    tokenizer = model_tokenizer(args.model)
    results = {"machine": machine.describe(), "model": args.model, "jax": jax.__version__, "backend": jax.default_backend(),
               "max_num_seqs": args.max_num_seqs, "num_requests": args.num_requests, "workloads": {}}
    for kind in args.workloads:
        spec = WorkloadSpec(num_requests=args.num_requests, seed=0, **WORKLOADS[kind])
        requests = build_workload(tokenizer, spec)
        warmup = build_workload(tokenizer, WorkloadSpec(num_requests=args.warmup_requests, seed=1, **WORKLOADS[kind]))
        print(f"{kind}: {describe(workload_lengths(requests))}", file=sys.stderr, flush=True)
        rows = {policy: run_policy(args, policy, warmup, requests) for policy in args.policies}
        base = rows.get("static")
        for row in rows.values():
            if base is not None:
                row["speed_vs_static"] = round(base["wall_s"] / row["wall_s"], 3)
                row["ideal_vs_static"] = round(base["steps"] / row["steps"], 3)
                row["share_of_ideal"] = round(row["speed_vs_static"] / row["ideal_vs_static"], 3)
                print(f"  {row['policy']:8s} {row['speed_vs_static']:.2f}x static, ideal (steps) "
                      f"{row['ideal_vs_static']:.2f}x: {row['share_of_ideal']:.0%} of it", flush=True)
        results["workloads"][kind] = {"lengths": describe(workload_lengths(requests)), "policies": list(rows.values())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {args.out}")
    return results


if __name__ == "__main__":
    main()
