"""The Pallas attention kernels' block sizes, measured on the GPU: for each (head_dim, page_size, dtype)
of pallas_kernels/block_sizes.DEFAULTS, a decode batch timed over the decode kernel's (num_warps,
num_stages), then a prefill over the query-block kernel's (block_q, num_warps, num_stages), the other
kernel's knobs left at the shape's defaults. Every candidate's output is held to the reference
(its largest |error| is kept: a knob that breaks the kernel shows). bench/gpu_run.sh runs it last.

    python bench/gpu_block_sweep.py --out sweep.json [--budget-s 60]   # on a GPU
    python bench/gpu_block_sweep.py --smoke                            # tiny shapes on CPU, interpreted

Every shape's decode sweep comes before any prefill sweep (decode steps dominate serving), the
shape's default first in each. It stops starting candidates after --budget-s, writes the JSON after
each candidate (a run killed at its limit keeps what it timed), and prints per shape and kernel the
default's time, the fastest candidate's and, where both kernels were swept, the DEFAULTS row to paste.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import gpu_check  # bench/, the script's own folder: the kernels section's batches and timing
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.block_sizes import BlockSizes, default_block_sizes

# (head_dim, page_size, dtype), the serving-critical first; query heads and KV heads per head_dim.
SHAPES = [(128, 16, jnp.bfloat16), (128, 32, jnp.bfloat16), (64, 16, jnp.bfloat16), (64, 32, jnp.bfloat16),
          (128, 16, jnp.float32), (128, 32, jnp.float32), (64, 16, jnp.float32), (64, 32, jnp.float32)]
HEADS = {128: (32, 8), 64: (32, 4)}  # Llama-3-8B's, TinyLlama's
DECODE = {"decode_num_warps": (2, 4, 8), "decode_num_stages": (2, 3, 4)}
PREFILL = {"block_q": (16, 32, 64), "num_warps": (4, 8), "num_stages": (1, 2, 3)}
SMOKE_SHAPES = [(16, 16, jnp.float32)]
SMOKE_HEADS = {16: (4, 2)}
SMOKE_DECODE = {"decode_num_warps": (4,), "decode_num_stages": (2, 3)}
SMOKE_PREFILL = {"block_q": (16, 32), "num_warps": (4,), "num_stages": (2,)}


def candidates(default: BlockSizes, grid: dict) -> list[BlockSizes]:
    """The default first, then every combination of the grid's knobs (the others at the default)."""
    swept = [dataclasses.replace(default, **dict(zip(grid, values))) for values in itertools.product(*grid.values())]
    return [default, *(b for b in swept if b != default)]


def sweep(shapes, heads_of, grids: dict, sizes: gpu_check.Sizes, on_gpu: bool, budget_s: float, rows: list,
          save) -> None:
    start = time.perf_counter()
    for kernel, batch in (("decode", "decode"), ("query_block", "prefill")):
        for head_dim, page_size, dtype in shapes:
            num_heads, num_kv_heads = heads_of[head_dim]
            args = gpu_check.kernel_batch(batch, (num_heads, num_kv_heads, head_dim), dtype, sizes, page_size)
            scale = head_dim ** -0.5
            with jax.default_matmul_precision("highest"):  # the oracle in full float32
                want = np.asarray(jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=scale))(*args),
                                  np.float32)
            default = default_block_sizes(head_dim, page_size, dtype)
            for block_sizes in candidates(default, grids[kernel]):
                if time.perf_counter() - start > budget_s:
                    return
                row = {"kernel": kernel, "head_dim": head_dim, "page_size": page_size, "dtype": jnp.dtype(dtype).name,
                       "block_sizes": dataclasses.asdict(block_sizes), "default": block_sizes == default}
                fn = jax.jit(lambda *a, b=block_sizes: ragged_paged_attention(*a, sm_scale=scale, block_sizes=b,
                                                                               interpret=not on_gpu))
                try:
                    row["max_abs_error"] = float(np.abs(np.asarray(fn(*args), np.float32) - want).max())
                    row["ms"] = 1000 * gpu_check.timed(fn, args, sizes.repeat)
                except Exception as error:  # noqa: BLE001 - a candidate that fails to compile is a finding
                    row["failed"] = f"{type(error).__name__}: {error}"[:1000]
                rows.append(row)
                save()


def summary(rows: list) -> list[str]:
    """Per (shape, kernel): the default's time and the fastest candidate's; the DEFAULTS row where both
    kernels were swept (pallas_kernels/block_sizes.py: head_dim, page, bytes, warps, stages, decode
    warps, decode stages; block_q alongside)."""
    lines, best, default_ms = [], {}, {}
    for row in rows:
        key = (row["head_dim"], row["page_size"], row["dtype"], row["kernel"])
        if "ms" in row:
            if row["default"]:
                default_ms[key] = row["ms"]
            if key not in best or row["ms"] < best[key]["ms"]:
                best[key] = row
    for key, fastest in best.items():
        head_dim, page, dtype, kernel = key
        knobs = {k: v for k, v in fastest["block_sizes"].items() if k in (DECODE if kernel == "decode" else PREFILL)}
        default = (f"default {default_ms[key]:.3f} ms, best {fastest['ms']:.3f} ms "
                   f"({default_ms[key] / fastest['ms']:.2f}x)" if key in default_ms else
                   f"default FAILED, best {fastest['ms']:.3f} ms")
        lines.append(f"{kernel:11s} head_dim {head_dim:3d} page {page:2d} {dtype:8s}: {default} at {knobs}")
    for (head_dim, page, dtype, kernel), fastest in best.items():
        other = best.get((head_dim, page, dtype, "query_block"))
        if kernel == "decode" and other:
            d, q = fastest["block_sizes"], other["block_sizes"]
            lines.append(f"DEFAULTS row: ({head_dim}, {page}, {jnp.dtype(dtype).itemsize}, {q['num_warps']}, "
                         f"{q['num_stages']}, {d['decode_num_warps']}, {d['decode_num_stages']})  # block_q {q['block_q']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script, measures nothing")
    parser.add_argument("--budget-s", type=float, default=60.0, help="start no candidate after this many seconds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    if not (on_gpu or args.smoke):
        parser.error(f"no GPU here (jax sees {device.platform}); run with --smoke to check the script on CPU")
    out = args.out or gpu_check.REPO / "bench" / "results" / ("gpu_block_sweep_smoke_new.json" if args.smoke else
                                                               f"gpu_block_sweep_{device.platform}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device_kind": device.device_kind, "jax": jax.__version__, "smoke": args.smoke,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": []}

    def save():
        out.write_text(json.dumps(result, indent=2) + "\n")

    shapes, heads, grids, sizes = (
        (SMOKE_SHAPES, SMOKE_HEADS, {"decode": SMOKE_DECODE, "query_block": SMOKE_PREFILL}, gpu_check.SMOKE)
        if args.smoke else (SHAPES, HEADS, {"decode": DECODE, "query_block": PREFILL}, gpu_check.FULL))
    sweep(shapes, heads, grids, sizes, on_gpu, args.budget_s, result["rows"], save)
    save()
    print("\n".join(summary(result["rows"])))
    failed = [row for row in result["rows"] if "failed" in row]
    print(f"{len(result['rows'])} candidates timed, {len(failed)} failed; saved {out}")


if __name__ == "__main__":
    main()
