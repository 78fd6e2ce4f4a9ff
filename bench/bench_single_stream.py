"""One user chatting: decode speed of a single request (greedy, a ~80-token prompt, 128 new tokens),
against the machine's memory-speed limit for the weights (every decode token reads all of them),
for each weight quantization asked (float32, the GGUF's own Q4_1 blocks, int8) and each
matmul_impl asked for the float matrices (auto: native on CPU; xla: XLA's dot, as before it), with
async scheduling on (the default: host work hides behind the device's) or off.

    python bench/bench_single_stream.py [--quantization none gguf int8] [--matmul-impl auto native xla]
                                        [--quantization-activations auto int8 float32]
                                        [--async-scheduling on off] [--max-num-seqs 32] [--runs 3]
                                        [--rounds 1] [--model smollm2-135m-instruct]
                                        [--llama-server http://127.0.0.1:8089]

`--rounds N` repeats the whole sweep N times, so the modes alternate (a shared machine's load drifts:
back-to-back runs of one mode would compare different moments). The load average is recorded at
each run. `--llama-server URL` (a llama-server on the same weights) alternates with it too: after
each run, the same prompt and greedy 128 tokens there, its own decode timing
(`timings.predicted_per_second`) kept beside the run as `llama_server_tok_s`, so that a slow spell
meets both sides of the ratio (bench/compare_llama_cpp.sh).

Prints one line per run and a summary per quantization; saves bench/results/single_stream_new.json
(or --out): decode tok/s (first token to last), ms per token, the buckets the steps ran in, the bytes
of the weights as held on the device (what a decode step reads), numpy's copy bandwidth in the same
run, the tok/s that bandwidth allows (copy bytes/s / weight bytes), the CPU and the native kernels'
instruction-set variant ($ORCA_JAX_NATIVE_ISA forces a lower one).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import urllib.request
from pathlib import Path

import jax

import machine
from orca_jax import LLM, SamplingParams
from orca_jax.config import (DEFAULT_MODEL, MATMUL_IMPL_CHOICES, QUANTIZATION_ACTIVATIONS_CHOICES, QUANTIZATION_CHOICES,
                             activations_for)

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 5


def llama_server_tok_s(url: str) -> float:
    """One request to a llama-server, as a run here: the same prompt, 128 greedy tokens; its decode tok/s."""
    body = json.dumps({"prompt": PROMPT, "n_predict": 128, "temperature": 0, "ignore_eos": True,
                       "cache_prompt": False}).encode()
    request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return float(json.load(response)["timings"]["predicted_per_second"])


def measure(model: str, quantization: str, matmul_impl: str, activations: str, async_scheduling: bool,
            max_num_seqs: int, num_runs: int, bandwidth: float, llama_server: str | None = None) -> dict:
    llm = LLM(model, max_num_seqs=max_num_seqs, quantization=quantization, matmul_impl=matmul_impl,
              quantization_activations=activations,
              async_scheduling=async_scheduling, show_progress=False)
    label = f"{quantization}, matmuls {llm.runner.matmul_impl}, async scheduling {'on' if async_scheduling else 'off'}"
    if quantization != "none":
        label += f", {activations_for(activations, quantization)} activations"
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm
    if llama_server is not None:
        llama_server_tok_s(llama_server)  # warm as well: its first request after start is not a run
    runs = []
    for _ in range(num_runs):
        llm.runner.stats.buckets = collections.Counter()
        out = llm.generate([PROMPT], params, use_tqdm=False)[0]
        metrics = out.metrics
        per_token = (metrics.finished_time - metrics.first_token_time) / (len(out.outputs[0].token_ids) - 1)
        runs.append({"decode_tok_s": 1 / per_token, "ms_per_token": 1000 * per_token, "load_average": os.getloadavg(),
                     "buckets": {f"{t}x{s}": n for (t, s), n in llm.runner.stats.buckets.items()}})
        print(f"{label}: decode {1 / per_token:.1f} tok/s ({1000 * per_token:.1f} ms/token), steps per (tokens x seqs) "
              f"bucket: {runs[-1]['buckets']}", flush=True)
        if llama_server is not None:
            runs[-1]["llama_server_tok_s"] = llama_server_tok_s(llama_server)
            print(f"  llama-server, right after: decode {runs[-1]['llama_server_tok_s']:.1f} tok/s", flush=True)
    weight_bytes = sum(x.nbytes for stage in llm.runner.stages for x in jax.tree.leaves(stage.params))
    return {"matmul_impl": llm.runner.matmul_impl, "async_scheduling": async_scheduling, "runs": runs,
            "weight_bytes": weight_bytes, "limit_tok_s": bandwidth / weight_bytes}


def with_best(name: str, result: dict) -> dict:
    """The mode's best run over every round so far, and its fraction of the memory-speed limit."""
    best = max(r["decode_tok_s"] for r in result["runs"])
    print(f"{name}: best {best:.1f} tok/s of {len(result['runs'])} runs; weights {result['weight_bytes'] / 1e6:.0f} MB "
          f"-> memory-speed limit {result['limit_tok_s']:.1f} tok/s; {best / result['limit_tok_s']:.0%} of it", flush=True)
    return {**result, "best_tok_s": best, "fraction_of_limit": best / result["limit_tok_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", nargs="+", choices=QUANTIZATION_CHOICES, default=["none", "gguf", "int8"])
    parser.add_argument("--matmul-impl", nargs="+", choices=MATMUL_IMPL_CHOICES, default=["auto"])
    parser.add_argument("--quantization-activations", nargs="+", choices=QUANTIZATION_ACTIVATIONS_CHOICES,
                        default=["auto"], help="for the quantized modes (none ignores it)")
    parser.add_argument("--async-scheduling", nargs="+", choices=["on", "off"], default=["on"])
    parser.add_argument("--rounds", type=int, default=1, help="sweeps of every mode, alternated")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "single_stream_new.json")
    parser.add_argument("--llama-server", metavar="URL",
                        help="a llama-server on the same weights: one request there after each run (see above)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a preset name or checkpoint folder (e.g. one `orca-jax convert` made of a Q4_K_M GGUF)")
    args = parser.parse_args()

    bandwidth = machine.copy_bandwidth()
    print(f"{machine.cpu_name()}, native kernels: {machine.native_isa()} variant; numpy copies {bandwidth / 1e9:.1f} GB/s", flush=True)
    modes = {}
    sweep = [(q, m, a, s) for q in args.quantization for m in args.matmul_impl
             for a in (args.quantization_activations if q != "none" else ["auto"]) for s in args.async_scheduling]
    for _ in range(args.rounds):
        for quantization, matmul_impl, activations, async_scheduling in sweep:
            name = quantization if matmul_impl == "auto" else f"{quantization}, matmul_impl {matmul_impl}"
            name += f", {activations} activations" if len(args.quantization_activations) > 1 and quantization != "none" else ""
            name += ", async scheduling off" if async_scheduling == "off" else ""
            result = measure(args.model, quantization, matmul_impl, activations, async_scheduling == "on",
                             args.max_num_seqs, args.runs, bandwidth, args.llama_server)
            if name in modes:  # a later round: its runs join the mode's
                result["runs"] = modes[name]["runs"] + result["runs"]
            modes[name] = with_best(name, result)
            gc.collect()  # the previous engine's weights and KV pages go before the next one's
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine.describe(), "model": str(args.model), "cpu": machine.cpu_name(), "native_isa": machine.native_isa(), "max_num_seqs": args.max_num_seqs,
                                    "copy_bytes_per_s": bandwidth, "quantization": modes}, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
