#!/usr/bin/env bash
# The whole GPU run, about 6 minutes: install the wheels that travelled (if any), record the machine
# (nvidia-smi, jax's devices, package versions), run the `gpu` tests, then bench/gpu_check.py's
# kernels and engine sections, and last the Pallas block sizes' sweep (bench/gpu_block_sweep.py).
# Each section runs under its own time limit, and everything is written into OUTDIR as it goes, so a
# run killed at any point keeps what it had measured:
#   run.log                  every section's output, then one line per section (ok / failed / timed out)
#   tests.xml                the gpu tests' JUnit report (run.log has their -v lines if it was cut short)
#   gpu_check_kernels.json   kernels against the reference and XLA, rewritten after each case
#   gpu_check_engine.json    the engine on Llama-3-8B-shaped random weights, rewritten after each batch size
#   gpu_block_sweep.json     each block-size candidate's time and error, rewritten after each candidate
#
# Through the device tool (nvidia-h200), after `bench/gpu_wheels.sh` here (optional: gguf and
# llguidance, which the image lacks and the run does not need):
#   run(command="bash bench/gpu_run.sh $OUT", carry=["gpu_wheels"], timeout_s=480)
# then keep the files it brings back in bench/results/. A second call after a fix can skip the sweep
# (command="SWEEP_S=0 bash bench/gpu_run.sh $OUT": about 90 s less).
#
#   bench/gpu_run.sh OUTDIR            # on a GPU machine
#   bench/gpu_run.sh --smoke OUTDIR    # here, on CPU (`make gpu-dry-run`): tiny shapes, and the packages
#                                      # the image lacks made unimportable (bench/gpu_image)
# Time limits in seconds: SETUP_S, TESTS_S, KERNELS_S, ENGINE_S, SWEEP_S (defaults below); PYTHON (python3).
set -uo pipefail  # no -e: a failing section is a finding, the next one still runs

SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
if [ $# -ne 1 ]; then
    echo "usage: bench/gpu_run.sh [--smoke] OUTDIR" >&2
    exit 2
fi
mkdir -p "$1" && OUT=$(cd "$1" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)

PYTHON=${PYTHON:-python3}
SETUP_S=${SETUP_S:-30}  # each of wheels, nvidia-smi, jax: under 8 minutes at worst, about 6 expected
TESTS_S=${TESTS_S:-120}
KERNELS_S=${KERNELS_S:-45}
ENGINE_S=${ENGINE_S:-120}
SWEEP_S=${SWEEP_S:-90}  # the sweep starts no candidate after SWEEP_S - 30 s (a backend's start, a last compile)
LOG="$OUT/run.log"
SITE=/tmp/orca_jax_gpu_wheels  # where travelling wheels are installed (the image's packages stay as they are)
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
CHECK_ARGS=()
if [ "$SMOKE" = 1 ]; then
    export PYTHONPATH="$REPO/bench/gpu_image:$PYTHONPATH"  # gguf and llguidance unimportable, as on the image
    CHECK_ARGS=(--smoke)
fi
: >"$LOG"
SUMMARY=()
FAILED=0

log() { echo "$*" | tee -a "$LOG"; }

# section NAME SECONDS COMMAND...: runs COMMAND under the time limit, its output into run.log as it comes.
section() {
    local name=$1 budget=$2 start=$SECONDS status verdict
    shift 2
    log "=== $name (at most $budget s): $*"
    timeout --kill-after=10 "$budget" "$@" 2>&1 | tee -a "$LOG"
    status=${PIPESTATUS[0]}
    case $status in
        0) verdict=ok ;;
        124 | 137) verdict="TIMED OUT at $budget s" ;;
        *) verdict="failed (exit $status)" ;;
    esac
    [ "$status" = 0 ] || FAILED=1
    SUMMARY+=("$(printf '%-8s %-24s %4d s' "$name" "$verdict" $((SECONDS - start)))")
}

MODE=$([ "$SMOKE" = 1 ] && echo " (--smoke, on CPU)")
log "orca_jax GPU run$MODE, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git describe --always --dirty 2>/dev/null || echo '?')"

# Setup: the travelling wheels, then what this machine is.
if [ "$SMOKE" = 1 ]; then
    log "wheels: not installed in a dry run (it imitates the image without gguf and llguidance)"
elif compgen -G "gpu_wheels/*.whl" >/dev/null; then
    section wheels "$SETUP_S" "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" gpu_wheels/*.whl
else
    log "wheels: no gpu_wheels/ here; gguf and llguidance stay missing (the run needs neither)"
fi
if command -v nvidia-smi >/dev/null; then
    section gpu "$SETUP_S" nvidia-smi
else
    log "gpu: no nvidia-smi on this machine"
fi
section jax "$SETUP_S" "$PYTHON" -c '
import importlib, importlib.metadata, sys
import jax
print("python", sys.version.split()[0], "at", sys.executable)
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "flax", "orbax-checkpoint", "numpy", "ml_dtypes", "optax",
             "jaxtyping", "tokenizers", "safetensors", "aiohttp"):
    try:
        print(f"  {name} {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        print(f"  {name} (not installed)")
for name in ("gguf", "llguidance"):  # optional (orca_jax/optional.py)
    try:
        importlib.import_module(name)
        print(f"  {name} {importlib.metadata.version(name)}")
    except ImportError:
        print(f"  {name}: cannot be imported (GGUF files / structured outputs unavailable; the run needs neither)")
print("devices:", jax.devices())'

# The gpu tests. An explicit JAX_PLATFORMS: tests/conftest.py then needs no guess about the GPU (a
# GPU that fails to start is an error, not every test skipped); the CPU stays the default device.
PLATFORMS=()
[ "$SMOKE" = 1 ] || PLATFORMS=(env JAX_PLATFORMS=cpu,cuda)
# Where they are: bench/gpu_check.py's GPU_TESTS (an empty list would have pytest collect every test).
read -ra GPU_TESTS <<<"$("$PYTHON" bench/gpu_check.py --print-gpu-tests 2>>"$LOG")"
if [ ${#GPU_TESTS[@]} -gt 0 ]; then
    section tests "$TESTS_S" "${PLATFORMS[@]}" "$PYTHON" -m pytest -v -m gpu "${GPU_TESTS[@]}" -p no:cacheprovider \
        --junitxml="$OUT/tests.xml"
else
    log "tests: bench/gpu_check.py --print-gpu-tests named none (its error is above); the gpu tests did not run"
    SUMMARY+=("$(printf '%-8s %-24s %4d s' tests "failed (no test paths)" 0)")
    FAILED=1
fi

# gpu_check.py, one process per section (each starts its own backend, under its own limit).
for name in kernels engine; do
    budget_var="${name^^}_S"
    section "$name" "${!budget_var}" "$PYTHON" bench/gpu_check.py "${CHECK_ARGS[@]}" --sections "$name" \
        --out "$OUT/gpu_check_$name.json"
done

# Last, as it is the least needed: the block sizes' sweep, as many candidates as its budget allows.
if [ "$SWEEP_S" -gt 30 ]; then
    section sweep "$SWEEP_S" "$PYTHON" bench/gpu_block_sweep.py "${CHECK_ARGS[@]}" --budget-s $((SWEEP_S - 30)) \
        --out "$OUT/gpu_block_sweep.json"
else
    log "sweep: skipped (SWEEP_S=$SWEEP_S)"
fi

log "=== summary (run.log, tests.xml, gpu_check_kernels.json, gpu_check_engine.json, gpu_block_sweep.json in $OUT)"
for line in "${SUMMARY[@]}"; do log "$line"; done
log "$SECONDS s in all"
exit "$FAILED"
