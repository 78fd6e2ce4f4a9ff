#!/usr/bin/env bash
# llama.cpp's `llama-server` for CPU, the baseline of `orca-jax bench serving --url`, built from the sources
# vendored in the `llama-cpp-python` sdist on PyPI; and the default model's GGUF beside it: the Q4_1 file
# `orca-jax pull` converts, and an F32 copy (what orca_jax computes with: the same weights dequantized).
#
#   bench/llama_cpp.sh [BUILD_DIR]    # default build/llama.cpp (git-ignored); run from the repository root
#
# Prints three paths, one a line: llama-server, the Q4_1 GGUF, the F32 GGUF. Then, for example:
#   llama-server -m <gguf> -np 16 -cb -c 16384 -t 2 --port 8080
#   orca-jax bench serving --url http://127.0.0.1:8080 --rates inf --max-concurrency 16 \
#       --workload throughput --num-requests 64
# Env: LLAMA_CPP_PYTHON_VERSION (default 0.3.36, the version measured in the README), JOBS (default 2),
# PYTHON (default .venv/bin/python), LLAMA_CPP_ISA (default native; `avx2`: a second build, in
# BUILD_DIR/cmake-avx2, whose kernels stop at AVX2 + FMA + F16C: what an AVX2-only CPU runs, for
# comparing on an AVX-512 host with orca_jax's own kernels forced to AVX2). About 20 minutes on 2
# shared cores; a second run only checks.
set -euo pipefail

BUILD_DIR=${1:-build/llama.cpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$BUILD_DIR"
BUILD_DIR=$(cd "$BUILD_DIR" && pwd)

SDIST="$BUILD_DIR/llama_cpp_python-$VERSION.tar.gz"
[ -f "$SDIST" ] || "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" \
    -d "$BUILD_DIR" >&2
SRC="$BUILD_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -d "$SRC" ] || tar -xzf "$SDIST" -C "$BUILD_DIR"

# CPU flags: -march=native, except on hosts with AMX (amx_tile in /proc/cpuinfo): there ggml's AMX
# path crashed, so build without -march=native and switch the AVX-512 families on by hand instead.
CMAKE_DIR="$BUILD_DIR/cmake"
case "${LLAMA_CPP_ISA:=native}" in
    native|avx2) ;;
    *) echo "LLAMA_CPP_ISA=$LLAMA_CPP_ISA: expected native (this CPU's best) or avx2" >&2; exit 2 ;;
esac
if [ "$LLAMA_CPP_ISA" = avx2 ]; then
    CMAKE_DIR="$BUILD_DIR/cmake-avx2"
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
               -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
               -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
elif grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
               -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
else
    CPU_FLAGS=(-DGGML_NATIVE=ON)
fi

# No network at build or run time: no HTTPS/curl, no prebuilt web UI fetched from Hugging Face.
BIN="$CMAKE_DIR/bin"
if [ ! -x "$BIN/llama-server" ] || [ ! -x "$BIN/llama-quantize" ]; then
cmake -S "$SRC" -B "$CMAKE_DIR" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
    "${CPU_FLAGS[@]}" >&2
cmake --build "$CMAKE_DIR" --target llama-server llama-quantize -j "$JOBS" >&2
fi  # built once: a second run only finds the files

# The default model's GGUF, out of the wheel `orca-jax pull` downloads (orca_jax/checkpoint/store.py).
Q4_1=$("$PYTHON" - "$BUILD_DIR" <<'PY'
import subprocess, sys, zipfile
from pathlib import Path
from orca_jax.checkpoint.store import PULL_SOURCES
source, out = PULL_SOURCES["smollm2-135m-instruct"], Path(sys.argv[1])
gguf = out / Path(source.member).name
if not gguf.exists():
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    source.pip_requirement, "-d", str(out)], check=True, stdout=sys.stderr)
    wheel = next(out.glob(source.pip_requirement.split("==")[0].replace("-", "_") + "-*.whl"))
    gguf.write_bytes(zipfile.ZipFile(wheel).read(source.member))
print(gguf)
PY
)
F32=${Q4_1%.Q4_1.gguf}.F32.gguf
[ -f "$F32" ] || "$BIN/llama-quantize" --allow-requantize "$Q4_1" "$F32" F32 >&2
printf '%s\n' "$BIN/llama-server" "$Q4_1" "$F32"
