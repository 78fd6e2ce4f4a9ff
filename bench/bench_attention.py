"""Ragged paged attention: the kernels (Pallas; native C++ on CPU) against the XLA implementation
and the reference.

    python bench/bench_attention.py                 # CPU: SmolLM2 shapes, f32, Pallas in interpret mode
    python bench/bench_attention.py --shape 13b     # GPU: a GPT-3 13B-like layer (40 heads x 128), bf16

For each batch kind (decodes over 256 and 512 cached tokens, a prefill, mixed) it checks every
implementation against `ragged_paged_attention_reference` and times it; prints a table and saves
bench/results/attention_<backend>_new.json (or --out; the committed figures are attention_<backend>.json).
On GPU the kernel is compiled with Triton; elsewhere it runs in interpret mode (a correctness path,
not a fast one). For decode batches each row also gives the effective bandwidth of the cached-context
read (K and V bytes of every decode token's context / time), printed beside the machine's copy
bandwidth measured here with numpy, so a reader sees how close to memory speed the read runs.
On CPU the native kernel runs once per instruction-set variant the CPU has (`native avx512`,
`native avx2`, `native base`), so the AVX2 code an AVX2-only CPU runs is timed beside AVX-512's in one
run; `--batches` and `--impls` narrow the table (e.g. `--batches "decode 64x256" --impls native`).
A call of one decode token takes microseconds, less than dispatching a jitted call from Python, so
`--chained N` times each implementation inside one jitted program of N + 1 calls, each fed the one
before's output, against a program of one call: the difference over N is the per-call time a model's
30 layers see (e.g. `--batches "decode 1x200" "decode 1x1000" --impls native --chained 30`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# This checkout's packages, not whichever orca_jax the environment installed (a script's own folder
# is on sys.path, the current directory is not).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from orca_jax.model.backends import native_cache_dir  # noqa: E402
from orca_jax.model.paged_attention import ragged_paged_attention_xla  # noqa: E402
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference  # noqa: E402
from pallas_kernels import native  # noqa: E402
from pallas_kernels.native import ragged_paged_attention_native, unavailable_reason  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {  # heads, kv heads, head dim, dtype
    "smollm2": (9, 3, 64, jnp.float32),
    "13b": (40, 40, 128, jnp.bfloat16),
}


BATCHES = {  # [(kv_len, new tokens)] per sequence; decode tokens first, as the engine orders them
    "decode 64x256": [(256, 1)] * 64,
    "decode 64x512": [(512, 1)] * 64,
    "decode 1x200": [(200, 1)],  # one request (use --chained: a lone call is mostly dispatch)
    "decode 1x1000": [(1000, 1)],
    "prefill 512": [(512, 512)],
    "mixed": [(512, 1)] * 32 + [(480, 480)],
}
DEFAULT_BATCHES = ["decode 64x256", "decode 64x512", "prefill 512", "mixed"]  # timed well by lone calls


def batch(kind: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype, page_size: int = 16, seed: int = 0):
    """decode: 64 sequences x 1 new token over 256 or 512 cached; prefill: one 512-token prompt;
    mixed: 32 decodes (512 cached) + a 480-token prompt."""
    seqs = BATCHES[kind]
    rng = np.random.default_rng(seed)
    max_pages = max(512, *(n for n, _ in seqs)) // page_size + 1  # (512: the pool the committed figures used)
    num_pages = len(seqs) * max_pages
    tables = rng.permutation(num_pages).reshape(len(seqs), max_pages).astype(np.int32)
    segments = np.concatenate([[s] * new for s, (_, new) in enumerate(seqs)]).astype(np.int32)
    positions = np.concatenate([np.arange(n - new, n) for n, new in seqs]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(len(segments), num_heads, head_dim)), dtype)
    k = jnp.asarray(rng.normal(size=(num_pages, page_size, num_kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.normal(size=(num_pages, page_size, num_kv_heads, head_dim)), dtype)
    lens = np.array([n for n, _ in seqs], np.int32)
    return q, k, v, jnp.asarray(segments), jnp.asarray(positions), jnp.asarray(tables), jnp.asarray(lens)


def context_bytes(inputs) -> int:
    """K and V bytes of the cached context the decode tokens (single-token segments) read."""
    q, k_pages, _, segments, positions, _, _ = inputs
    segments, positions = np.asarray(segments), np.asarray(positions)
    decodes = np.bincount(segments)[segments] == 1
    _, _, num_kv_heads, head_dim = k_pages.shape
    return int(positions[decodes].sum()) * num_kv_heads * head_dim * k_pages.dtype.itemsize * 2


def run_times(fn, args, repeat: int) -> list[float]:
    """Seconds of `repeat` calls of fn(*args), after a warm one."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def timed(fn, args, repeat: int) -> float:
    """Best of `repeat` calls after a warm one: on cores shared with other jobs the mean mostly
    measures the neighbours; the best call is the kernel's own cost."""
    return min(run_times(fn, args, repeat))


def timed_in_program(fn, args, calls: int, repeat: int) -> float:
    """Seconds per call of `fn` inside one jitted program: (calls + 1 chained calls) minus 1 call,
    over `calls`, each the median of `repeat` runs (the difference of two best-ofs is noisier). A
    call cheaper than the runs' noise can come out at or below zero: it is reported as measured."""
    def program(n):
        def run(q, *rest):
            for _ in range(n):
                q = fn(q, *rest).astype(q.dtype)
            return q
        return jax.jit(run)

    median = lambda n: float(np.median(run_times(program(n), args, repeat)))  # noqa: E731
    return (median(calls + 1) - median(1)) / calls


def main() -> None:
    backend = jax.default_backend()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 13b on GPU, smollm2 elsewhere")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / f"attention_{backend}_new.json",
                        help="results JSON (default: a new file, not the committed attention_<backend>.json)")
    parser.add_argument("--batches", nargs="+", choices=sorted(BATCHES),
                        default=DEFAULT_BATCHES)
    parser.add_argument("--impls", nargs="+", default=None, help="implementations by name prefix (default: all)")
    parser.add_argument("--chained", type=int, default=0, metavar="N",
                        help="time each call inside a program of N + 1 chained calls (default 0: lone calls)")
    args = parser.parse_args()
    shape = args.shape or ("13b" if backend == "gpu" else "smollm2")
    num_heads, num_kv_heads, head_dim, dtype = SHAPES[shape]
    repeat = args.repeat or (20 if backend == "gpu" else 3)
    scale = 1.0 / head_dim ** 0.5
    on_gpu = backend == "gpu"
    impls = {"xla": jax.jit(lambda *a: ragged_paged_attention_xla(*a, sm_scale=scale))}
    if backend == "cpu":
        reason = unavailable_reason(native_cache_dir())
        if reason is None:
            for isa in native.supported_isas():
                def run(*a, isa=isa):
                    native.select_isa(isa)  # read by the kernel at each call: no recompilation
                    return ragged_paged_attention_native(*a, sm_scale=scale)
                impls[f"native {isa}"] = run
        else:
            print(f"native: not available ({reason})")
    impls["pallas" if on_gpu else "pallas-interpret"] = \
        lambda *a: ragged_paged_attention(*a, sm_scale=scale, interpret=not on_gpu)
    if args.impls:
        impls = {name: fn for name, fn in impls.items() if name.startswith(tuple(args.impls))}
    reference = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=scale))
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    copy_gbps = machine.copy_bandwidth() / 1e9
    print(f"{machine.cpu_name()}; memory: a numpy copy moves {copy_gbps:.1f} GB/s (reads + writes, one thread); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if backend == "cpu" and unavailable_reason(native_cache_dir()) is None:
        print(f"native variants: {', '.join(native.supported_isas())}; {native.isa()} runs by default here "
              f"(${native.ISA_ENV} forces a lower one)")
    rows = []
    for kind in args.batches:
        inputs = batch(kind, num_heads, num_kv_heads, head_dim, dtype)
        want = np.asarray(reference(*inputs), np.float32)
        context = context_bytes(inputs) if kind.startswith("decode") else 0
        for name, fn in impls.items():
            got = np.asarray(fn(*inputs), np.float32)
            error = float(np.abs(got - want).max())
            # (the call above also selected this variant: the kernel reads it at each call)
            seconds = timed_in_program(fn, inputs, args.chained, 10 * repeat) if args.chained else timed(fn, inputs, repeat)
            row = {"batch": kind, "impl": name, "ms": 1000 * seconds, "max_abs_error": error,
                   "correct": error <= tolerance * max(1.0, float(np.abs(want).max()))}
            read = ""
            if context and seconds > 0:  # (a chained difference within the noise can come out <= 0)
                row["context_gb_per_s"] = context / seconds / 1e9
                read = f"  context read {row['context_gb_per_s']:5.1f} GB/s (copy {copy_gbps:.1f})"
            rows.append(row)
            print(f"{kind:14s} {name:17s} {1000 * seconds:9.3f} ms   max |error| {error:.2e}  "
                  f"{'ok' if row['correct'] else 'WRONG'}{read}", flush=True)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine.describe(), "backend": backend, "cpu": machine.cpu_name(), "jax": jax.__version__, "shape": shape,
                               "dtype": str(jnp.dtype(dtype)), "chained": args.chained, "copy_gb_per_s": copy_gbps, "load_average": os.getloadavg(), "rows": rows},
                              indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
