"""The quantized matmul (pallas_kernels/quantized_matmul.py) on SmolLM2's layer shapes: the native
kernel per instruction-set variant the CPU has, against XLA's dequantize-then-dot, per token count.

    python bench/bench_quantized_matmul.py [--format q4_1] [--layers 6] [--tokens 1 2 4 8 16 32 64 128]

For each T: ms for the matrices of `--layers` layers (q, k, v, o, gate, up, down; random weights in
the format; for the K-quants, whose rows are multiples of 256 weights, a layer of width 768 and
intermediate 2048 instead of SmolLM2's 576 and 1536, filled with random blocks of small scales), the weight bytes read per ms as GB/s, and XLA's time over the native kernel's (for
`--format f32`, XLA's is the float model's own dot over [in, out] kernels: matmul_impl="xla"). Prints the
CPU, numpy's copy bandwidth in the same run and a table; every format but f32 is timed twice per
variant, with float32 activations (`<isa>_ms`) and with int8 ones (`<isa>_int8_ms`, llama.cpp's method:
pallas_kernels/int8_activations.py); saves bench/results/quantized_matmul_new.json
(or --out). Where the two cross is what NATIVE_MAX_TOKENS encodes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
# This checkout's packages, not whichever orca_jax the environment installed (a script's own folder
# is on sys.path, the current directory is not).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import machine  # noqa: E402

from orca_jax.model.backends import native_cache_dir  # noqa: E402
from pallas_kernels import native  # noqa: E402
from pallas_kernels import quantized_matmul as qm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # (out, in)
LAYER_K = [(768, 768), (256, 768), (256, 768), (768, 768), (2048, 768), (2048, 768), (768, 2048)]
GGUF_TYPES = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
              "q8_0": gguf.GGMLQuantizationType.Q8_0, "q5_0": gguf.GGMLQuantizationType.Q5_0,
              "q5_1": gguf.GGMLQuantizationType.Q5_1}


def layer(format: str) -> list[tuple[int, int]]:
    return LAYER_K if qm.block_weights(format) == qm.SUPER_BLOCK else LAYER


def weights(format: str, layers: int, rng) -> list[tuple[jax.Array, jax.Array | None]]:
    out = []
    for shape in layer(format) * layers:
        w = rng.standard_normal(shape).astype(np.float32)
        if format in ("q4_k", "q5_k", "q6_k"):
            # Random blocks (gguf-py has no K-quant quantizer) with small scales, so the weights stay of
            # order one and the chain of layers finite; the kernel's time does not depend on the values.
            scale = 1 / (127 * 32) if format == "q6_k" else 1 / (63 * 16)
            data, scales = qm.random_blocks(format, shape[0], shape[1] // qm.SUPER_BLOCK, rng, scale), None
        elif format == "f32":
            data, scales = w, None
        elif format == "int8":
            data, scales = qm.quantize_int8(w)
        else:
            data, scales = gguf.quants.quantize(w, GGUF_TYPES[format]), None
        out.append((jnp.asarray(data), None if scales is None else jnp.asarray(scales)))
    return out


def program(matmul, format: str):
    """One jitted call of every matrix, each fed the previous output, as in a model: the calls run
    one after another (fed the same input, XLA ran independent calls at once and the figures at one
    token came out 1.6x better than the model's own calls). The scaling keeps values finite."""
    def run(x, mats):
        shapes = layer(format)
        for (out, inner), (data, scales) in zip(shapes * (len(mats) // len(shapes)), mats):
            x = x[:, :inner] if x.shape[1] >= inner else jnp.tile(x, (1, -(-inner // x.shape[1])))[:, :inner]
            x = matmul(x, format, data, scales) * (1.0 / np.sqrt(inner))
        return x.sum()
    return jax.jit(run)


def best_of(fn, args, repeat: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", choices=qm.FORMATS, default="q4_1")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--isas", nargs="+", choices=native.ISAS, default=None,
                        help="native variants to time (default: every one this CPU has)")
    parser.add_argument("--out", type=Path, default=RESULTS / "quantized_matmul_new.json")
    args = parser.parse_args()
    reason = native.unavailable_reason(native_cache_dir())
    if reason is not None:
        sys.exit(f"native kernels unavailable: {reason}")
    mats = weights(args.format, args.layers, np.random.default_rng(0))
    nbytes = sum(d.nbytes for d, _ in mats)
    bandwidth = machine.copy_bandwidth()
    print(f"{machine.cpu_name()}; numpy copies {bandwidth / 1e9:.1f} GB/s; {args.format}, {args.layers} layers "
          f"({nbytes / 1e6:.1f} MB of weights)")
    native_fn, xla_fn = program(qm.quantized_matmul_native, args.format), program(qm.quantized_matmul_xla, args.format)
    int8_fn = None
    if args.format in qm.INT8_ACTIVATION_FORMATS:
        int8_fn = program(lambda x, format, data, scales: qm.quantized_matmul_native(x, format, data, scales, None, "int8"),
                          args.format)
    xla_mats = mats
    if args.format == "f32":  # XLA's side is the float model's own dot (matmul_impl="xla"), over [in, out]
        xla_mats = [(jnp.asarray(np.asarray(d).T), s) for d, s in mats]
        xla_fn = program(lambda x, format, kernel, scales: x @ kernel, args.format)
    isas, rows = tuple(i for i in native.supported_isas() if args.isas is None or i in args.isas), []
    chosen = native.isa()
    print(f"native variants timed: {', '.join(isas)}; the kernels run {chosen} by default here "
          f"(${native.ISA_ENV} forces a lower one); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for tokens in args.tokens:
        width = layer(args.format)[0][1]
        x = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, width)).astype(np.float32))
        row = {"tokens": tokens, "xla_ms": 1000 * best_of(xla_fn, (x, xla_mats), args.repeat)}
        for isa in isas:
            native.select_isa(isa)
            row[f"{isa}_ms"] = 1000 * best_of(native_fn, (x, mats), args.repeat)
            row[f"{isa}_gb_per_s"] = nbytes / row[f"{isa}_ms"] / 1e6
            if int8_fn is not None:
                row[f"{isa}_int8_ms"] = 1000 * best_of(int8_fn, (x, mats), args.repeat)
                row[f"{isa}_int8_gb_per_s"] = nbytes / row[f"{isa}_int8_ms"] / 1e6
        native.select_isa(chosen)
        rows.append(row)

        def cell(isa: str) -> str:
            text = f"{isa} {row[f'{isa}_ms']:7.2f} ms ({nbytes / row[f'{isa}_ms'] / 1e6:5.1f} GB/s)"
            if int8_fn is not None:
                text += f" int8 x {row[f'{isa}_int8_ms']:7.2f} ms ({row[f'{isa}_int8_gb_per_s']:5.1f} GB/s)"
            return text
        cells = "  ".join(cell(isa) for isa in isas)
        print(f"T={tokens:4d}  {cells}  xla {row['xla_ms']:7.2f} ms  xla/{isas[0]} "
              f"{row['xla_ms'] / row[f'{isas[0]}_ms']:.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine.describe(), "cpu": machine.cpu_name(), "format": args.format, "layers": args.layers,
                                    "weight_bytes": nbytes, "copy_bytes_per_s": bandwidth, "isas": list(isas),
                                    "default_isa": chosen, "load_average": os.getloadavg(), "rows": rows}, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
