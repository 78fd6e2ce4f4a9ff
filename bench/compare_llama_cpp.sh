#!/usr/bin/env bash
# orca_jax against llama.cpp's llama-server on the throughput workload (64 requests, prompts 100-300,
# outputs 8-256, all at once), in one run, at equal concurrency: `-np N -cb` against
# `--max-num-seqs N`. llama-server runs the default model's Q4_1 GGUF (what llama.cpp users run) and
# its F32 copy (the weights orca_jax computes with), with one thread per core, as orca_jax uses.
#
#   bench/compare_llama_cpp.sh [N]     # default 16; run from the repository root, on a quiet machine
#
# Writes bench/results/vs_llama_cpp_{orca_jax,q4_1,f32}_new.json and prints the table.
set -euo pipefail

N=${1:-16}
BENCH=(.venv/bin/orca-jax bench serving --rates inf --max-concurrency "$N" --workload throughput --num-requests 64)
readarray -t BUILT < <(bench/llama_cpp.sh)
LLAMA_SERVER=${BUILT[0]}

"${BENCH[@]}" --policies chunked orca --max-num-seqs "$N" --out bench/results/vs_llama_cpp_orca_jax_new.json

for weights in q4_1 f32; do
    gguf=${BUILT[1]}; [ "$weights" = f32 ] && gguf=${BUILT[2]}
    "$LLAMA_SERVER" -m "$gguf" -np "$N" -cb -c $((N * 1024)) -t "$(nproc)" --port 8089 >/dev/null 2>&1 &
    server=$!
    until curl -sf http://127.0.0.1:8089/health >/dev/null; do sleep 1; done
    "${BENCH[@]}" --url http://127.0.0.1:8089 --out "bench/results/vs_llama_cpp_${weights}_new.json" || true
    kill "$server"; wait "$server" 2>/dev/null || true
done

.venv/bin/python - <<'PY'
import json
from pathlib import Path
rows = {}
for name in ("orca_jax", "q4_1", "f32"):
    for label, runs in json.loads(Path(f"bench/results/vs_llama_cpp_{name}_new.json").read_text())["policies"].items():
        rows[f"orca_jax {label}" if name == "orca_jax" else f"llama-server {name.upper()}"] = runs["rates"][0]
best_llama = max(r["output_throughput"] for k, r in rows.items() if k.startswith("llama"))
print(f"{'server':24s} {'ok':>6s} {'tok/s':>7s} {'TTFT p50':>9s} {'ITL p50':>8s}  vs best llama-server")
for name, r in rows.items():
    print(f"{name:24s} {r['ok']:>3d}/{r['requests']:<2d} {r['output_throughput']:7.1f} {r['ttft_s_p50']:8.2f}s "
          f"{1000 * r['itl_s_p50']:6.0f}ms  {r['output_throughput'] / best_llama:.2f}x")
PY
