"""Start-up time of `orca-jax serve`: seconds from process start to the first `GET /health` 200,
with no caches (a fresh clone) and again with the caches the first start wrote (a second start).

    python bench/bench_startup.py                      # default settings, writes bench/results/startup_new.json
    python bench/bench_startup.py -- --max-num-seqs 16 # flags after -- go to `orca-jax serve`

Each run gets its own empty $ORCA_JAX_COMPILATION_CACHE, so the figures never depend on this
checkout's caches; only the native attention kernel is built into it first, untimed, as the README's
install (`make setup`) does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import machine

ROOT = Path(__file__).resolve().parent.parent


def time_to_health(cache: str, port: int, serve_flags: list[str], limit_s: float) -> float:
    env = dict(os.environ, ORCA_JAX_COMPILATION_CACHE=cache)
    command = [sys.executable, "-m", "orca_jax.cli", "serve", "--port", str(port), *serve_flags]
    start = time.perf_counter()
    server = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.perf_counter() - start < limit_s:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}:\n{server.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"no /health 200 within {limit_s:.0f} s")
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--limit", type=float, default=900, help="seconds to wait for /health")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "startup_new.json")
    parser.add_argument("serve_flags", nargs="*", help="flags for `orca-jax serve` (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="orca-jax-cache-") as cache:
        subprocess.run([sys.executable, "-m", "orca_jax.native", "--require"], cwd=ROOT, check=True,
                       env=dict(os.environ, ORCA_JAX_COMPILATION_CACHE=cache))
        fresh = time_to_health(cache, args.port, args.serve_flags, args.limit)
        print(f"first start (no caches): /health 200 after {fresh:.1f} s", flush=True)
        second = time_to_health(cache, args.port, args.serve_flags, args.limit)
        print(f"second start (caches from the first): /health 200 after {second:.1f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine.describe(), "serve_flags": args.serve_flags, "first_start_s": round(fresh, 1),
                                    "second_start_s": round(second, 1)}, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
