"""Serving load generator: a workload replayed against an OpenAI-compatible server at a sweep of rates.

    python bench/bench_serving.py --policies static orca chunked --rates 0.5 1 2 4   # starts one server each
    python bench/bench_serving.py --url http://127.0.0.1:8000 --rates 1 2 inf         # any running server
    python bench/bench_serving.py --url http://127.0.0.1:8000 --rates inf --max-concurrency 16

Each request streams `/v1/completions` with the workload's prompt and `max_tokens` (greedy,
`ignore_eos`, so output lengths are the workload's). Arrivals are Poisson at each rate (`inf`: all
at once; with --max-concurrency, a closed loop of that many clients). Per request: time to first
token, inter-token latency, end-to-end and normalised latency (seconds per output token). Per rate:
throughput and percentiles. Per policy: the capacity under a latency target, the highest rate
whose p99 normalised latency stays under it (Orca's headline measure).

Saves bench/results/serving_new.json and serving_new.png (normalised latency against throughput), or
where --out says; the committed figures are serving.json and serving.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from stats import percentiles  # noqa: E402
from workloads import build_workload, load_jsonl, named_spec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    token_gaps_s: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(session: aiohttp.ClientSession, url: str, model: str, request, send_text: bool) -> RequestResult:
    body = {"model": model, "prompt": request.prompt if send_text else request.prompt_token_ids,
            "max_tokens": request.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last, gaps, tokens, first = None, [], None, math.nan
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return RequestResult(False, error=f"{response.status}: {(await response.text())[:200]}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if "error" in chunk:
                    return RequestResult(False, error=chunk["error"]["message"])
                now = time.perf_counter()
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if last is None:
                        first = now - start
                    else:
                        gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except aiohttp.ClientError as error:
        return RequestResult(False, error=str(error))
    end = time.perf_counter()
    return RequestResult(True, tokens if tokens is not None else len(gaps) + 1, first, end - start, gaps)


async def run_rate(url: str, model: str, workload, rate: float, max_concurrency: int | None, send_text: bool,
                   seed: int = 0) -> dict:
    """Replays the workload with Poisson arrivals at `rate` requests/s (inf: all at once)."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(workload))
    # A fresh connection per request: reusing pooled keep-alive connections, some requests to llama-server
    # failed with 'Server disconnected' (3-7 of 64 in a closed loop of 16); a connect costs well under a ms.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def delayed(request, at):
            await asyncio.sleep(at)
            async with limit:
                return await one_request(session, url, model, request, send_text)

        at, tasks = 0.0, []
        for request in workload:
            tasks.append(asyncio.create_task(delayed(request, at)))
            if math.isfinite(rate):
                at += rng.expovariate(rate)
        start = time.perf_counter()
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return summarize(results, wall, rate, max_concurrency)


def flat_percentiles(values, name: str) -> dict:
    """stats.percentiles of the measured values (NaN: not measured), as flat `<name>_p50` keys."""
    summary = percentiles([v for v in values if not math.isnan(v)])
    return {f"{name}_{key}": value for key, value in summary.items()}


def summarize(results: list[RequestResult], wall: float, rate: float, max_concurrency: int | None) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    # "errors": up to 5 distinct messages; how many failed is requests - ok.
    row = {"rate": rate if math.isfinite(rate) else "inf", "max_concurrency": max_concurrency,
           "requests": len(results), "ok": len(ok), "errors": sorted({r.error for r in results if not r.ok})[:5],
           "wall_s": wall, "request_throughput": len(ok) / wall, "output_throughput": tokens / wall}
    row.update(flat_percentiles([r.ttft_s for r in ok], "ttft_s"))
    row.update(flat_percentiles([g for r in ok for g in r.token_gaps_s], "itl_s"))
    row.update(flat_percentiles([r.e2e_s for r in ok], "e2e_s"))
    row.update(flat_percentiles([r.e2e_s / r.output_tokens for r in ok], "normalized_s_per_token"))
    return row


def capacity(rows: list[dict], target_s_per_token: float) -> float:
    """The highest finite swept rate whose p99 normalised latency is under the target (0 if none)."""
    good = [r["rate"] for r in rows if r["rate"] != "inf" and r["ok"] == r["requests"]
            and r.get("normalized_s_per_token_p99", math.inf) <= target_s_per_token]
    return max(good, default=0.0)


# ---- one server per policy -------------------------------------------------------------------

async def first_model(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/models") as response:
            return (await response.json())["data"][0]["id"]


def server_log(policy: str) -> Path:
    return RESULTS / f"serving_{policy}.log"


def start_server(policy: str, port: int, args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, "-m", "orca_jax.cli", "serve", "--model", args.model, "--policy", policy,
               "--port", str(port), "--served-model-name", "bench", "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-queued-requests", "100000",
               "--quantization", args.quantization] + ([] if args.async_scheduling else ["--no-async-scheduling"])
    with open(server_log(policy), "w") as log:  # the child keeps its own copy of the handle
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def sweep(url: str, model: str, workload, args: argparse.Namespace, label: str) -> list[dict]:
    rows = []
    for rate in args.rates:
        row = await run_rate(url, model, workload, rate, args.max_concurrency, args.send_text)
        rows.append(row)
        print(f"{label:8s} rate {rate:5.2f}/s  {row['request_throughput']:5.2f} req/s  "
              f"{row['output_throughput']:6.1f} tok/s  TTFT p50 {row.get('ttft_s_p50', math.nan):6.2f} "
              f"p99 {row.get('ttft_s_p99', math.nan):6.2f} s  ITL p50 {1000 * row.get('itl_s_p50', math.nan):5.0f} ms  "
              f"norm p99 {row.get('normalized_s_per_token_p99', math.nan):.3f} s/tok  ok {row['ok']}/{row['requests']}",
              flush=True)
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for label, entry in results["policies"].items():
        rows = [r for r in entry["rates"] if r["rate"] != "inf"]
        ax.plot([r["request_throughput"] for r in rows], [r["normalized_s_per_token_p99"] for r in rows], "o-",
                label=f"{label} (capacity {entry['capacity']:g} req/s)")
    ax.axhline(results["latency_target_s_per_token"], color="grey", linestyle="--", label="latency target")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("p99 normalised latency (s / output token)")
    ax.set_title(f"{results['model']}, {results['workload']} workload, {results['num_requests']} requests")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def parse_rate(text: str) -> float:
    return math.inf if text == "inf" else float(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server; default: start one per --policies")
    parser.add_argument("--served-model", default=None, help="the model id of the --url server (default: its first)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="what the started servers load")
    parser.add_argument("--policies", nargs="+", default=["static", "orca", "chunked"])
    parser.add_argument("--workload", default="zipf", help="zipf, uniform, equal or throughput (bench/workloads.py)")
    parser.add_argument("--workload-file", type=Path, help="a JSONL workload instead of --workload")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--rates", nargs="+", type=parse_rate, default=[0.25, 0.5, 1.0, 1.5])
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--latency-target", type=float, default=0.5, help="p99 seconds per output token")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--quantization", default="none", help="of the started servers' weights: none, gguf or int8")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="of the started servers (default on; --no-async-scheduling steps one at a time)")
    parser.add_argument("--send-text", action="store_true", help="send prompts as text, not token ids")
    parser.add_argument("--out", type=Path, default=RESULTS / "serving_new.json",
                        help="results JSON, the plot beside it (default: a new file, not the committed serving.json)")
    args = parser.parse_args(argv)

    from orca_jax.checkpoint.convert import ensure_pulled
    from orca_jax.runner.builder import model_tokenizer
    from orca_jax.tuning.loadgen import free_port, wait_ready

    if args.workload_file:
        workload = load_jsonl(args.workload_file)
    else:
        ensure_pulled(args.model, log=print)
        tokenizer = model_tokenizer(args.model)
        workload = build_workload(tokenizer, named_spec(args.workload, args.num_requests))
    results = {"machine": machine.describe(), "model": args.model, "workload": str(args.workload_file or args.workload),
               "num_requests": len(workload), "latency_target_s_per_token": args.latency_target,
               "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
               "policies": {}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    targets = [("server", args.url, None)] if args.url else [(p, None, p) for p in args.policies]
    for label, url, policy in targets:
        process = None
        if policy is not None:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            process = start_server(policy, port, args)
            asyncio.run(wait_ready(url, process, 900, server_log(policy)))
        try:
            model = "bench" if policy else (args.served_model or asyncio.run(first_model(url)))
            rows = asyncio.run(sweep(url, model, workload, args, label))
        finally:
            if process is not None:
                process.send_signal(signal.SIGTERM)
                process.wait(120)
        results["policies"][label] = {"rates": rows, "capacity": capacity(rows, args.latency_target)}
        print(f"{label}: capacity under p99 {args.latency_target} s/token = "
              f"{results['policies'][label]['capacity']:g} req/s", flush=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    if any(math.isfinite(r) for r in args.rates):
        plot(results, args.out.with_suffix(".png"))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
