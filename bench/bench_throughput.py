"""Offline throughput of every scheduling policy on one mixed workload (the engine issue's figures).

    python bench/bench_throughput.py [--policies chunked orca] [--num-requests 64]

Prints one line per policy and saves bench/results/throughput_new.json (or --out): generated tokens/s, wall time,
steps, padding waste, host time per step against the step, preemptions; plus the decode step's
FLOP/s at 64 running sequences against a plain f32 matmul measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from workloads import mixed_workload  # noqa: E402

from orca_jax import LLM, SamplingParams  # noqa: E402
from orca_jax.config import SchedulerConfig  # noqa: E402
from orca_jax.engine.engine import LLMEngine  # noqa: E402
from orca_jax.runner.model_runner import RunnerStats  # noqa: E402
from orca_jax.engine.step_plan import padding_plan  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def run_policy(llm: LLM, policy: str, workload, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    config = dataclasses.replace(llm.config, scheduler=SchedulerConfig(
        policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens))
    engine = LLMEngine(config, llm.engine.model_config, llm.runner, llm.tokenizer, llm.engine.max_model_len)
    llm.runner.stats = RunnerStats()
    start = time.perf_counter()
    for request in workload:
        engine.add_request(request.prompt_token_ids,
                           SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - start
    stats = llm.runner.stats
    host = engine.step_time_s - stats.device_s
    return {
        "policy": policy,
        "generated_tokens": engine.num_generated_tokens,
        "wall_s": wall,
        "tokens_per_s": engine.num_generated_tokens / wall,
        "steps": engine.num_steps,
        "mean_tokens_per_step": stats.real_tokens / stats.steps,
        "padding_fraction": 1 - stats.real_tokens / stats.padded_tokens,
        "host_ms_per_step": 1000 * host / stats.steps,
        "device_ms_per_step": 1000 * stats.device_s / stats.steps,
        "host_fraction_of_step": host / engine.step_time_s,
        "preemptions": engine.scheduler.num_preemptions,
    }


def timed(fn, *args, repeat: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeat):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeat


def decode_flops(llm: LLM, num_seqs: int, context: int) -> dict:
    """A decode step of `num_seqs` sequences with `context` cached tokens each, against f32 matmuls."""
    runner = llm.runner
    config = runner.config
    pages = -(-context // runner.page_size)
    assert num_seqs * pages <= runner.num_pages
    plan = padding_plan(num_seqs, num_seqs, runner.kv_layout, config.vocab_size)
    tables = plan.block_tables  # [max_num_seqs, max_pages]: the first num_seqs rows are used
    tables[:num_seqs, :pages] = np.arange(num_seqs * pages).reshape(num_seqs, pages)
    plan.token_ids[:] = np.arange(num_seqs)
    plan.positions[:] = context - 1
    plan.segment_ids[:] = np.arange(num_seqs)
    plan.slot_mapping[:] = (tables[:num_seqs, (context - 1) // runner.page_size] * runner.page_size
                            + (context - 1) % runner.page_size)
    plan.kv_lens[:num_seqs] = context
    plan.logits_index[:num_seqs] = np.arange(num_seqs)
    plan.num_real_tokens, plan.sampling.num_real_rows = num_seqs, np.int32(num_seqs)
    seconds = timed(lambda: jax.device_get(runner.run_plan(plan)))
    step_flop = 2 * config.num_params() * num_seqs
    big = jnp.ones((1024, 1024), jnp.float32)
    matmul_s = timed(jax.jit(lambda a: a @ a), big, repeat=20)
    x, w = jnp.ones((num_seqs, config.d_model)), jnp.ones((config.d_model, config.d_ff))
    same_shape_s = timed(jax.jit(lambda x, w: x @ w), x, w, repeat=50)
    kv_bytes = (2 * config.n_layers * num_seqs * (context - 1) * config.n_kv_heads * config.head_dim
                * runner.kv_dtype.itemsize)  # the cached context the step reads: K and V, every layer
    return {
        "num_seqs": num_seqs, "context": context, "step_ms": 1000 * seconds, "kv_read_bytes": int(kv_bytes),
        "step_gflops": step_flop / seconds / 1e9,
        "matmul_1024_gflops": 2 * 1024 ** 3 / matmul_s / 1e9,
        "matmul_same_m_gflops": 2 * num_seqs * config.d_model * config.d_ff / same_shape_s / 1e9,
    }


def cached_context_cost(short: dict, long: dict) -> dict:
    extra_s = (long["step_ms"] - short["step_ms"]) / 1000
    return {"ratio": long["step_ms"] / short["step_ms"], "extra_ms": 1000 * extra_s,
            "kv_read_bytes": long["kv_read_bytes"], "effective_gb_s": long["kv_read_bytes"] / max(extra_s, 1e-9) / 1e9,
            "copy_gb_s": machine.copy_bandwidth() / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--policies", nargs="+", default=["static", "orca", "paged", "chunked"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--attention-impl", default="auto", choices=["auto", "native", "xla"])
    parser.add_argument("--out", type=Path, default=RESULTS / "throughput_new.json",
                        help="results JSON (default: a new file, not the committed throughput.json)")
    args = parser.parse_args()

    llm = LLM(args.model, max_num_seqs=max(args.max_num_seqs, 64), max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_dtype=args.kv_cache_dtype, attention_impl=args.attention_impl)
    llm.runner.run_first_runs()  # every program's slow first run, before the timing (a server's idle thread does it)
    workload = mixed_workload(llm.tokenizer, args.num_requests)
    results = {"machine": machine.describe(), "model": args.model, "backend": jax.default_backend(), "jax": jax.__version__,
               "num_requests": args.num_requests, "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_dtype": args.kv_cache_dtype,
               "attention": llm.runner.attention_impl, "policies": []}
    for policy in args.policies:
        row = run_policy(llm, policy, workload, args.max_num_seqs, args.max_num_batched_tokens)
        results["policies"].append(row)
        print(f"{policy:8s} {row['tokens_per_s']:7.1f} tok/s  {row['wall_s']:6.1f} s  {row['steps']:4d} steps  "
              f"padding {row['padding_fraction']:.0%}  host {row['host_ms_per_step']:.1f} ms/step "
              f"({row['host_fraction_of_step']:.1%} of step)  preemptions {row['preemptions']}", flush=True)
    results["decode"] = [decode_flops(llm, 64, 1), decode_flops(llm, 64, 256)]
    for d in results["decode"]:
        print(f"decode step, {d['num_seqs']} seqs x {d['context']} context: {d['step_ms']:.0f} ms, "
              f"{d['step_gflops']:.0f} GFLOP/s; f32 matmul 1024^3 {d['matmul_1024_gflops']:.0f}, "
              f"same-M {d['matmul_same_m_gflops']:.0f} GFLOP/s")
    results["cached_context"] = cached_context_cost(*results["decode"])
    c = results["cached_context"]
    print(f"cached context: the 256-token step costs {c['ratio']:.2f}x the 1-token one; its extra "
          f"{c['extra_ms']:.1f} ms read {c['kv_read_bytes'] / 1e6:.0f} MB of K/V = {c['effective_gb_s']:.1f} GB/s "
          f"(this machine copies {c['copy_gb_s']:.1f} GB/s: read + write, machine.copy_bandwidth)")
    results["compilations_after_warmup"] = llm.num_compilations_after_warmup
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {args.out}; compilations after warm-up: {llm.num_compilations_after_warmup}")


if __name__ == "__main__":
    main()
