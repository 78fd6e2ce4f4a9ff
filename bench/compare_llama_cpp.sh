#!/usr/bin/env bash
# orca_jax against llama.cpp's llama-server, in one run, on the same weights at each precision:
# orca_jax --quantization gguf (the default model's own Q4_1 blocks) against llama-server on that Q4_1
# GGUF, and orca_jax float32 against llama-server on its F32 copy (the same weights dequantized).
#   1. one request (single stream): decode tok/s of 128 greedy tokens after the same ~80-token prompt
#      (bench/bench_single_stream.py; llama-server's own `timings.predicted_per_second`);
#   2. the throughput workload (64 requests, prompts 100-300, outputs 8-256, all at once) at equal
#      concurrency: `-np N -cb` against `--max-num-seqs N`.
# One thread per core for llama-server, as orca_jax uses. Prints the CPU model and the variant the
# native kernels run ($ORCA_JAX_NATIVE_ISA=avx2 forces the AVX2 one for orca_jax).
#
#   bench/compare_llama_cpp.sh [N]     # default 16; run from the repository root, on a quiet machine
#
# Writes bench/results/vs_llama_cpp_{orca_jax,orca_jax_gguf,q4_1,f32,single_stream}_new.json, prints
# the tables, and gathers the figures with the machine's description (CPU, kernel variant, date, commit)
# in bench/results/vs_llama_cpp_new.json: the file to copy to bench/results/latest/vs_llama_cpp_<cpu>.json
# (bench/results/README.md), from which docs/performance.md and README's headline table are made.
set -euo pipefail

N=${1:-16}
PY=.venv/bin/python
BENCH=(.venv/bin/orca-jax bench serving --rates inf --max-concurrency "$N" --workload throughput --num-requests 64)
readarray -t BUILT < <(bench/llama_cpp.sh)
LLAMA_SERVER=${BUILT[0]}
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) cores"
$PY -m orca_jax.native

PYTHONPATH=$PWD $PY bench/bench_single_stream.py --quantization none gguf --runs 3 \
    --out bench/results/vs_llama_cpp_single_stream_new.json
"${BENCH[@]}" --policies chunked --max-num-seqs "$N" --out bench/results/vs_llama_cpp_orca_jax_new.json
"${BENCH[@]}" --policies chunked --max-num-seqs "$N" --quantization gguf \
    --out bench/results/vs_llama_cpp_orca_jax_gguf_new.json

PROMPT=$(PYTHONPATH=$PWD $PY -c "import sys; sys.path.insert(0, 'bench'); from bench_single_stream import PROMPT; print(PROMPT)")
for weights in q4_1 f32; do
    gguf=${BUILT[1]}; [ "$weights" = f32 ] && gguf=${BUILT[2]}
    "$LLAMA_SERVER" -m "$gguf" -np "$N" -cb -c $((N * 1024)) -t "$(nproc)" --port 8089 >/dev/null 2>&1 &
    server=$!
    until curl -sf http://127.0.0.1:8089/health >/dev/null; do sleep 1; done
    for run in 1 2 3; do  # one request alone: llama-server's own decode timing
        $PY -c 'import json, sys; print(json.dumps({"prompt": sys.argv[1], "n_predict": 128, "temperature": 0,
                 "ignore_eos": True, "cache_prompt": False}))' "$PROMPT" |
            curl -sf http://127.0.0.1:8089/completion -H 'Content-Type: application/json' -d @- |
            $PY -c 'import json, sys; print(json.load(sys.stdin)["timings"]["predicted_per_second"])'
    done > "bench/results/vs_llama_cpp_${weights}_single_stream_new.txt"
    "${BENCH[@]}" --url http://127.0.0.1:8089 --out "bench/results/vs_llama_cpp_${weights}_new.json" || true
    kill "$server"; wait "$server" 2>/dev/null || true
done

N="$N" PYTHONPATH=$PWD $PY - <<'PY'
import json
import os
import sys
from pathlib import Path
sys.path.insert(0, "bench")
import machine
R = Path("bench/results")
single = json.loads((R / "vs_llama_cpp_single_stream_new.json").read_text())
print(f"\none request, decode tok/s (best of 3), native kernels: {single['native_isa']}")
for orca, llama in (("gguf", "q4_1"), ("none", "f32")):
    mine = single["quantization"][orca]["best_tok_s"]
    theirs = max(float(x) for x in (R / f"vs_llama_cpp_{llama}_single_stream_new.txt").read_text().split())
    print(f"  orca_jax {orca:4s} {mine:6.1f}   llama-server {llama.upper():4s} {theirs:6.1f}   {mine / theirs:.2f}x")
rows = {}
for name, label in (("orca_jax", "orca_jax f32"), ("orca_jax_gguf", "orca_jax Q4_1"), ("q4_1", "llama-server Q4_1"),
                    ("f32", "llama-server F32")):
    for runs in json.loads((R / f"vs_llama_cpp_{name}_new.json").read_text())["policies"].values():
        rows[label] = runs["rates"][0]
print(f"\n{'64 requests':24s} {'ok':>6s} {'tok/s':>7s} {'TTFT p50':>9s} {'ITL p50':>8s}  vs llama-server Q4_1")
for name, r in rows.items():
    print(f"{name:24s} {r['ok']:>3d}/{r['requests']:<2d} {r['output_throughput']:7.1f} {r['ttft_s_p50']:8.2f}s "
          f"{1000 * r['itl_s_p50']:6.0f}ms  {r['output_throughput'] / rows['llama-server Q4_1']['output_throughput']:.2f}x")
llama_single = {w: [float(x) for x in (R / f"vs_llama_cpp_{w}_single_stream_new.txt").read_text().split()]
                for w in ("q4_1", "f32")}
combined = {"bench": "vs_llama_cpp", "machine": machine.describe(), "concurrency": int(os.environ["N"]),
            "single_stream": single, "llama_server_single_stream_tok_s": llama_single,
            "serving": {"orca_jax_f32": rows["orca_jax f32"], "orca_jax_q4_1": rows["orca_jax Q4_1"],
                        "llama_server_q4_1": rows["llama-server Q4_1"], "llama_server_f32": rows["llama-server F32"]}}
(R / "vs_llama_cpp_new.json").write_text(json.dumps(combined, indent=1) + "\n")
print(f"\nsaved {R / 'vs_llama_cpp_new.json'}")
PY
