"""Memory of a GGUF served in place (`--quantization gguf`) against its file size, and against the
same checkpoint served in float32: the memory plan's parameter bytes and the process's peak RSS
over one short `orca-jax generate` run each. Issue 39's target: the weights take no more than 1.2x
the file.

    python bench/bench_gguf_memory.py --model CHECKPOINT_DIR [--out results/DATE/gguf_memory_CPU.json]

CHECKPOINT_DIR is one `orca-jax convert FILE.gguf` made (it keeps the file as model.gguf).
"""
import argparse
import json
import os
import re
import sys
from pathlib import Path

import machine

GENERATE = ("--max-num-seqs 2 --max-num-batched-tokens 32 --kv-cache-memory 16MiB --max-model-len 256 "
            "--max-tokens 8 --temperature 0 Hello").split()


def serve_once(model: str, quantization: str) -> dict:
    """One `orca-jax generate` run: its peak RSS and the parameter bytes its memory plan printed."""
    command = [sys.executable, "-m", "orca_jax.cli", "generate", "--model", model, "--quantization", quantization,
               *GENERATE]
    [run] = machine.run_with_peak_rss([command])
    if run.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr[-2000:]}")
    planned = re.search(r"parameters ([\d.]+) MiB/device", run.stderr)
    return {"peak_rss_mib": run.peak_rss_mib, "plan_parameters_mib": float(planned.group(1)),
            "output": run.stdout.strip().splitlines()[-1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory converted from a GGUF file")
    parser.add_argument("--out", help="result JSON, relative to bench/")
    args = parser.parse_args()
    file_mib = os.path.getsize(Path(args.model) / "model.gguf") / 2**20
    result = {"machine": machine.describe(), "model": args.model, "gguf_file_mib": round(file_mib, 1)}
    for quantization in ("gguf", "none"):
        run = serve_once(args.model, quantization)
        run["parameters_over_file"] = round(run["plan_parameters_mib"] / file_mib, 3)
        result[quantization] = run
        print(quantization, run, flush=True)
    if args.out:
        path = Path(__file__).resolve().parent / args.out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", path)


if __name__ == "__main__":
    main()
