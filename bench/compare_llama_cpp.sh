#!/usr/bin/env bash
# orca_jax against llama.cpp's llama-server, in one run, on the same weights at each precision:
# orca_jax --quantization gguf (a GGUF file's own blocks; by default the default model's Q4_1 file)
# against llama-server on that GGUF, and orca_jax float32 against llama-server on its F32 copy (the
# same weights dequantized).
#   1. one request (single stream): decode tok/s of 128 greedy tokens after the same ~80-token prompt
#      (bench/bench_single_stream.py; llama-server's own `timings.predicted_per_second`), RUNS runs
#      each (default 3), alternated (ours, theirs, ours, ...): a slow spell of the machine meets both
#      sides. Printed: best against best, and the median of the pairs' own ratios;
#   2. the throughput workload (64 requests, prompts 100-300, outputs 8-256, all at once) at equal
#      concurrency: `-np N -cb` against `--max-num-seqs N` (SERVING=0 skips it).
# WITH_F32=0 skips the float32 pair (its figures do not depend on the GGUF file's block types).
# One thread per core for llama-server, as orca_jax uses. Prints the CPU model, the file's block types
# and the variant the native kernels run. ORCA_JAX_NATIVE_ISA=avx2 stands in for an AVX2-only CPU on an
# AVX-512 one, on both sides: orca_jax's native kernels run their AVX2 variant, XLA's own code stops at
# AVX2 (--xla_cpu_max_isa=AVX2), and llama-server is a build of llama.cpp without AVX-512
# (LLAMA_CPP_ISA=avx2 bench/llama_cpp.sh).
#
#   bench/compare_llama_cpp.sh [N] [FILE.gguf]   # default 16 and SmolLM2's Q4_1 file; from the repository
#                                                # root, on a quiet machine
#
# Another GGUF file (a Q4_K_M, say) is served as it is by both engines, and copied to F32 once
# (build/compare/<stem>/) for the float32 pair; its figures are named by the type in its name
# (smollm2.Q4_K_M.gguf: q4_k_m; LABEL=... overrides).
# Writes bench/results/vs_llama_cpp_{orca_jax,orca_jax_gguf,<label>,f32,single_stream_gguf,single_stream_none}_new.json, prints
# the tables, and gathers the figures with the machine's description (CPU, kernel variant, date, commit)
# in bench/results/vs_llama_cpp_new.json: for the default file, the file to copy to
# bench/results/latest/vs_llama_cpp_<cpu>.json (bench/results/README.md), from which docs/performance.md
# and README's headline table are made.
set -euo pipefail

N=${1:-16}
FILE=${2:-}
SERVING=${SERVING:-1}
RUNS=${RUNS:-3}
WITH_F32=${WITH_F32:-1}
PY=.venv/bin/python
BENCH=(.venv/bin/orca-jax bench serving --rates inf --max-concurrency "$N" --workload throughput --num-requests 64)
LLAMA_CPP_ISA=native
if [ "${ORCA_JAX_NATIVE_ISA:-}" = avx2 ]; then
    LLAMA_CPP_ISA=avx2
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_max_isa=AVX2"
fi
export LLAMA_CPP_ISA
readarray -t BUILT < <(bench/llama_cpp.sh)
LLAMA_SERVER=${BUILT[0]}
if [ -z "$FILE" ]; then
    GGUF=${BUILT[1]} F32=${BUILT[2]} MODEL=smollm2-135m-instruct LABEL=${LABEL:-q4_1}
else
    # Both engines serve the file as it is (orca_jax: its own blocks; --quantization none: its float copy)
    GGUF=$(realpath "$FILE")
    STEM=$(basename "$GGUF" .gguf)
    WORK=build/compare/$STEM
    MODEL=$GGUF F32=$WORK/$STEM.F32.gguf
    TYPE=${STEM##*.}; [ "$TYPE" = "$STEM" ] && TYPE=gguf
    LABEL=${LABEL:-$(echo "$TYPE" | tr '[:upper:]' '[:lower:]')}
    mkdir -p "$WORK"
    if [ "$WITH_F32" != 0 ] && [ ! -f "$F32" ]; then
        "$(dirname "$LLAMA_SERVER")/llama-quantize" --allow-requantize "$GGUF" "$F32" F32 >&2
    fi
fi
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(nproc) cores; llama-server: $LLAMA_SERVER ($LLAMA_CPP_ISA build); XLA_FLAGS: ${XLA_FLAGS:-none}"
echo "file: $GGUF ($LABEL); tensors by type: $($PY -c 'import collections, sys, gguf
r = gguf.GGUFReader(sys.argv[1])
print(", ".join(f"{n} {t}" for t, n in collections.Counter(t.tensor_type.name for t in r.tensors).most_common()))' "$GGUF")"
$PY -m orca_jax.native

# Each file's llama-server is up while our runs on the same weights alternate with its own; it idles
# (no CPU) while our serving runs go.
PAIRS=("$LABEL"); [ "$WITH_F32" != 0 ] && PAIRS+=(f32)
for weights in "${PAIRS[@]}"; do
    gguf=$GGUF quantization=gguf ours=orca_jax_gguf model=$MODEL
    [ "$weights" = f32 ] && gguf=$F32 quantization=none ours=orca_jax
    [ "$weights" = f32 ] && [ -n "$FILE" ] && model=$F32
    "$LLAMA_SERVER" -m "$gguf" -np "$N" -cb -c $((N * 1024)) -t "$(nproc)" --port 8089 >/dev/null 2>&1 &
    server=$!
    until curl -sf http://127.0.0.1:8089/health >/dev/null; do sleep 1; done
    PYTHONPATH=$PWD $PY bench/bench_single_stream.py --model "$model" --quantization "$quantization" --runs "$RUNS" \
        --llama-server http://127.0.0.1:8089 --out "bench/results/vs_llama_cpp_single_stream_${quantization}_new.json"
    if [ "$SERVING" != 0 ]; then
        "${BENCH[@]}" --model "$model" --policies chunked --max-num-seqs "$N" --quantization "$quantization" \
            --out "bench/results/vs_llama_cpp_${ours}_new.json"
        "${BENCH[@]}" --url http://127.0.0.1:8089 --out "bench/results/vs_llama_cpp_${weights}_new.json" || true
    fi
    kill "$server"; wait "$server" 2>/dev/null || true
done

N="$N" LABEL="$LABEL" GGUF="$GGUF" SERVING="$SERVING" WITH_F32="$WITH_F32" PYTHONPATH=$PWD $PY - <<'PY'
import json
import os
import statistics
import sys
from pathlib import Path
sys.path.insert(0, "bench")
import machine
R = Path("bench/results")
label = os.environ["LABEL"]
# The two single-stream runs (each alternated with its llama-server) as one record.
with_f32 = os.environ["WITH_F32"] != "0"
pairs = (("gguf", label), ("none", "f32")) if with_f32 else (("gguf", label),)
single = json.loads((R / "vs_llama_cpp_single_stream_gguf_new.json").read_text())
if with_f32:
    single["quantization"].update(json.loads((R / "vs_llama_cpp_single_stream_none_new.json").read_text())["quantization"])
llama_single = {llama: [run["llama_server_tok_s"] for run in single["quantization"][orca]["runs"]] for orca, llama in pairs}
print(f"\none request, decode tok/s (best runs, alternated), native kernels: {single['native_isa']}")
for orca, llama in pairs:
    runs = single["quantization"][orca]["runs"]
    mine, theirs = single["quantization"][orca]["best_tok_s"], max(llama_single[llama])
    ratios = [run["decode_tok_s"] / run["llama_server_tok_s"] for run in runs]
    print(f"  orca_jax {orca:4s} {mine:6.1f}   llama-server {llama.upper():6s} {theirs:6.1f}   {mine / theirs:.2f}x; "
          f"pair by pair {' '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}x")
combined = {"bench": "vs_llama_cpp", "machine": machine.describe(), "concurrency": int(os.environ["N"]),
            "gguf_file": os.environ["GGUF"], "forced_native_isa": os.environ.get("ORCA_JAX_NATIVE_ISA"),
            "llama_cpp_isa": os.environ["LLAMA_CPP_ISA"], "xla_flags": os.environ.get("XLA_FLAGS"),
            "single_stream": single, "llama_server_single_stream_tok_s": llama_single}
if os.environ["SERVING"] != "0":
    rows = {}
    names = (("orca_jax_gguf", f"orca_jax {label.upper()}"), (label, f"llama-server {label.upper()}"))
    if with_f32:
        names += (("orca_jax", "orca_jax f32"), ("f32", "llama-server F32"))
    for name, title in names:
        for runs in json.loads((R / f"vs_llama_cpp_{name}_new.json").read_text())["policies"].values():
            rows[title] = runs["rates"][0]
    theirs = rows[f"llama-server {label.upper()}"]["output_throughput"]
    print(f"\n{'64 requests':24s} {'ok':>6s} {'tok/s':>7s} {'TTFT p50':>9s} {'ITL p50':>8s}  vs llama-server {label.upper()}")
    for name, r in rows.items():
        print(f"{name:24s} {r['ok']:>3d}/{r['requests']:<2d} {r['output_throughput']:7.1f} {r['ttft_s_p50']:8.2f}s "
              f"{1000 * r['itl_s_p50']:6.0f}ms  {r['output_throughput'] / theirs:.2f}x")
    combined["serving"] = {f"orca_jax_{label}": rows[f"orca_jax {label.upper()}"],
                           f"llama_server_{label}": rows[f"llama-server {label.upper()}"]}
    if with_f32:
        combined["serving"].update(orca_jax_f32=rows["orca_jax f32"], llama_server_f32=rows["llama-server F32"])
(R / "vs_llama_cpp_new.json").write_text(json.dumps(combined, indent=1) + "\n")
print(f"\nsaved {R / 'vs_llama_cpp_new.json'}")
PY
