"""The first-GPU check, one script: the `gpu` tests, the kernels against the reference and XLA, and
the engine end to end on Llama-3-8B-shaped random bf16 weights. bench/gpu_run.sh runs it section by
section, each in its own process under its own time limit.

    python bench/gpu_check.py             # on a GPU machine (nothing fetched: the repository + its jax)
    python bench/gpu_check.py --smoke     # the same code at tiny shapes on CPU (`make gpu-dry-run`)
    python bench/gpu_check.py --sections kernels,engine --out results.json   # some sections only

1. tests: `pytest -m gpu` over GPU_TESTS (tests/gpu and the batched == solo matrix) in a
   subprocess (on CPU they are all skipped, which it reports).
2. kernels: at Llama-3-8B (32 / 8 heads x 128) and 13B-like (40 / 40 x 128) shapes, bf16 and f32, for
   a decode batch, a prefill and a mixed batch: the largest |error| of the Pallas kernel and of the XLA
   implementation against the reference (computed in full float32), and their times.
3. engine: a Llama-3-8B-shaped model (32 layers, d 4096, GQA 32:8, d_ff 14336, vocab 128256) with
   random weights made on the device (`--load-format dummy`, checkpoint/dummy.py), bf16, at B = 1, 16,
   64 and 256 requests of 128 prompt tokens: decode tok/s, the decode step's time and its host overhead
   (step wall time minus the runner's dispatch + wait), and MBU = bytes read per decode step (every
   weight but the embedding table, plus the KV cache read) / step time / the device's bandwidth (a
   table of known parts; otherwise a copy measured on the device, said so). With the Pallas kernel;
   should that fail, again with the XLA attention. A failing section is reported, the others still run.

Writes one JSON (bench/results/gpu_check_gpu.json; --smoke: gpu_check_smoke_new.json, git-ignored;
or --out), again after each section and each engine batch size, so a run killed at its time limit
keeps what it measured; prints one table at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere, nothing installed but jax & co

from orca_jax.checkpoint.dummy import DummyWeights  # noqa: E402
from orca_jax.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,  # noqa: E402
                             matmul_precision_for)
from orca_jax.engine.engine import LLMEngine  # noqa: E402
from orca_jax.engine.step_plan import Buckets  # noqa: E402
from orca_jax.engine_args import config_from_keywords  # noqa: E402
from orca_jax.model.decoder import abstract_decoder  # noqa: E402
from orca_jax.model.paged_attention import ragged_paged_attention_xla  # noqa: E402
from orca_jax.runner.model_runner import ModelRunner  # noqa: E402
from orca_jax.sampling_params import SamplingParams  # noqa: E402
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference  # noqa: E402

# Peak memory bandwidth of known parts, bytes/s, by a substring of jax's device_kind (first match).
BANDWIDTH = [("H200", 4.8e12), ("GH200", 4.0e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
             ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
             ("L4", 0.3e12), ("A10", 0.6e12), ("RTX 4090", 1.008e12)]
KERNEL_SHAPES = {"llama3-8b": (32, 8, 128), "llama2-13b": (40, 40, 128)}  # heads, KV heads, head dim
SECTIONS = ("tests", "kernels", "engine")
# Where the `gpu` tests are (bench/gpu_run.sh reads them with --print-gpu-tests): tests/gpu and the
# GPU cases of the batched == solo matrix. Not `pytest -m gpu tests`: that would import every test
# module, some of which need gguf, which the GPU image lacks.
GPU_TESTS = ("tests/gpu", "tests/engine/test_batched_equals_solo.py")
LLAMA3_8B = ModelConfig(name="llama3-8b-dummy", architecture="llama", vocab_size=128256, d_model=4096, n_layers=32,
                        n_heads=32, n_kv_heads=8, d_ff=14336, max_position=8192, rope_theta=500000.0,
                        tie_word_embeddings=False, dtype="bfloat16")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run measures: the full check on a GPU, or the same code at tiny shapes (--smoke)."""

    kernel_shapes: dict
    kernel_dtypes: tuple
    decode_batch: tuple  # (sequences, cached tokens each) of the kernels' decode batch
    prefill_tokens: int
    model: ModelConfig
    batch_sizes: tuple  # engine requests per run
    prefill_budget: int  # max_num_batched_tokens: above the largest batch, so prompts get in while others decode
    prompt_tokens: int
    new_tokens: int
    repeat: int  # kernel timings


FULL = Sizes(KERNEL_SHAPES, (jnp.bfloat16, jnp.float32), (64, 1024), 512, LLAMA3_8B, (1, 16, 64, 256), 2048, 128, 64, 20)
SMOKE = Sizes({"tiny": (4, 2, 16)}, (jnp.float32,), (4, 40), 24,
              dataclasses.replace(LLAMA3_8B, name="tiny-dummy", vocab_size=256, d_model=32, n_layers=2, n_heads=4,
                                  n_kv_heads=2, d_ff=64, dtype="float32"), (1, 4), 32, 20, 4, 2)


def run_gpu_tests(timeout: float) -> dict:
    """The `gpu` tests in a fresh process; counts from its JUnit XML."""
    # The repository first, and whatever PYTHONPATH already holds (bench/gpu_image's import blocker).
    python_path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *GPU_TESTS, "-p",
                                   "no:cacheprovider", f"--junitxml={report}"], cwd=REPO, capture_output=True,
                                  text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": python_path})
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        seconds = time.perf_counter() - start
        xml = report.read_text() if report.exists() else ""
    counts = {k: int(v) for k, v in re.findall(r'(tests|failures|errors|skipped)="(\d+)"', xml)[:4]}
    failed = re.findall(r'<testcase [^>]*name="([^"]+)"[^>]*>\s*<(?:failure|error)', xml)
    return {"returncode": done.returncode, "seconds": seconds, **counts, "failed": failed,
            "tail": done.stdout[-1500:]}


def kernel_batch(kind: str, heads, dtype, sizes: Sizes, page_size: int = 16, seed: int = 0):
    num_seqs, cached = sizes.decode_batch
    seqs = {"decode": [(cached, 1)] * num_seqs, "prefill": [(sizes.prefill_tokens, sizes.prefill_tokens)],
            "mixed": [(cached, 1)] * (num_seqs // 2) + [(sizes.prefill_tokens, sizes.prefill_tokens // 2)]}[kind]
    num_heads, num_kv_heads, head_dim = heads
    rng = np.random.default_rng(seed)
    max_pages = -(-max(n for n, _ in seqs) // page_size)
    num_pages = len(seqs) * max_pages
    tables = rng.permutation(num_pages).reshape(len(seqs), max_pages).astype(np.int32)
    segments = np.concatenate([[s] * new for s, (_, new) in enumerate(seqs)]).astype(np.int32)
    positions = np.concatenate([np.arange(n - new, n) for n, new in seqs]).astype(np.int32)
    q = rng.normal(size=(len(segments), num_heads, head_dim))
    k = rng.normal(size=(num_pages, page_size, num_kv_heads, head_dim))
    v = rng.normal(size=(num_pages, page_size, num_kv_heads, head_dim))
    lens = np.array([n for n, _ in seqs], np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(segments),
            jnp.asarray(positions), jnp.asarray(tables), jnp.asarray(lens))


def timed(fn, args, repeat: int) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeat


def check_kernels(sizes: Sizes, on_gpu: bool, rows: list, save) -> None:
    """Each kernel case's error and time, appended to `rows` as it goes (calling `save`). One
    implementation failing on a case is that row's finding; the other is still measured."""
    for shape, heads in sizes.kernel_shapes.items():
        scale = heads[2] ** -0.5
        pallas = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale, interpret=not on_gpu))
        xla = jax.jit(lambda *a: ragged_paged_attention_xla(*a, sm_scale=scale))
        reference = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=scale))
        for dtype in sizes.kernel_dtypes:
            # As the engine runs them: float32 in full precision (no TF32), 16-bit at XLA's default.
            precision = matmul_precision_for("auto", jnp.dtype(dtype).name)
            for kind in ("decode", "prefill", "mixed"):
                args = kernel_batch(kind, heads, dtype, sizes)
                with jax.default_matmul_precision("highest"):  # the oracle in full float32
                    want = np.asarray(reference(*args), np.float32)
                row = {"shape": shape, "dtype": jnp.dtype(dtype).name, "batch": kind}
                for name, fn in (("pallas", pallas), ("xla", xla)):
                    try:
                        with jax.default_matmul_precision(precision):
                            got = np.asarray(fn(*args), np.float32)
                            row[f"{name}_max_abs_error"] = float(np.abs(got - want).max())
                            row[f"{name}_ms"] = 1000 * timed(fn, args, sizes.repeat)
                    except Exception as error:  # noqa: BLE001 - a failing kernel is a finding, not a stop
                        row[f"{name}_failed"] = f"{type(error).__name__}: {error}"[:2000]
                if "pallas_ms" in row and "xla_ms" in row:
                    row["pallas_over_xla_speed"] = row["xla_ms"] / row["pallas_ms"]
                rows.append(row)
                save()


def device_bandwidth(device) -> tuple[float, str]:
    """(bytes/s, where from): the table's figure for a known part, else a copy timed on the device."""
    kind = device.device_kind
    for name, bandwidth in BANDWIDTH:
        if name in kind:
            return bandwidth, f"table ({name})"
    x = jax.device_put(jnp.ones((256 << 20) // 4, jnp.float32), device)
    copy = jax.jit(lambda a: a * 2)
    seconds = timed(copy, (x,), 10)
    return 2 * x.nbytes / seconds, f"measured copy on {kind}"


def run_engine(sizes: Sizes, device, bandwidth: float, attention_impl: str, rows: list, save) -> None:
    """Decode tok/s, step time, host overhead and MBU at each batch size, one warm runner for all.
    Appends to `rows` as it goes (the runner's facts, then one row per batch size), calling `save`."""
    config = sizes.model
    largest = max(sizes.batch_sizes)
    page_size = 16
    pages_per_seq = -(-(sizes.prompt_tokens + sizes.new_tokens) // page_size)
    tokens = tuple(sorted({*sizes.batch_sizes, sizes.prefill_budget}))  # decode steps run at T = B
    # The weights are made on the device, one parameter at a time (as `--load-format dummy`).
    settings = config_from_keywords(page_size=page_size, attention_impl=attention_impl)
    runner = ModelRunner(abstract_decoder(config), settings, num_pages=largest * pages_per_seq + 8,
                         max_model_len=pages_per_seq * page_size,
                         buckets=Buckets(tokens=tokens, seqs=tuple(sorted(sizes.batch_sizes))), devices=[device],
                         weights=DummyWeights(seed=0))
    warm_s = runner.warm_up(show_progress=False)
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(runner.stages[0].params))
    weight_bytes -= config.vocab_size * config.d_model * jnp.dtype(config.dtype).itemsize  # the table: B rows read
    kv_bytes_per_token = config.n_layers * 2 * config.n_kv_heads * config.head_dim * runner.kv_dtype.itemsize
    engine_config = EngineConfig(cache=CacheConfig(page_size=page_size), scheduler=SchedulerConfig(
        policy="chunked", max_num_seqs=largest, max_num_batched_tokens=sizes.prefill_budget))
    engine = LLMEngine(engine_config, config, runner, None, max_model_len=pages_per_seq * page_size)
    rows.append({"warm_up_s": warm_s, "weight_bytes": weight_bytes, "attention": runner.attention_impl})
    save()
    rng = np.random.default_rng(0)
    for batch in sizes.batch_sizes:
        params = SamplingParams(temperature=0, max_tokens=sizes.new_tokens, ignore_eos=True)
        ids = [engine.add_request(rng.integers(0, config.vocab_size, sizes.prompt_tokens).tolist(), params)
               for _ in range(batch)]
        started, decode_steps, host_s = set(), [], []
        while engine.has_unfinished_requests():
            all_decoding = len(started) == batch
            device_before = runner.stats.device_s
            start = time.perf_counter()
            outputs = engine.step()
            wall = time.perf_counter() - start
            if all_decoding:  # every request past its prompt: a decode-only step of B rows
                decode_steps.append(wall)
                host_s.append(wall - (runner.stats.device_s - device_before))
            started |= {out.request_id for out in outputs if out.outputs[0].token_ids}
        assert started == set(ids)
        if not decode_steps:
            raise RuntimeError(f"B={batch}: no step had every request decoding; raise new_tokens")
        step_s = float(np.median(decode_steps))
        mean_context = sizes.prompt_tokens + sizes.new_tokens / 2
        bytes_per_step = weight_bytes + batch * mean_context * kv_bytes_per_token
        rows.append({"batch": batch, "decode_steps": len(decode_steps), "step_ms": 1000 * step_s,
                     "decode_tok_per_s": batch / step_s, "host_ms": 1000 * float(np.median(host_s)),
                     "bytes_per_step": bytes_per_step, "mbu": bytes_per_step / step_s / bandwidth})
        save()
    assert runner.num_compilations_after_warmup == 0


def section(result: dict, name: str, run) -> bool:
    """Runs one section; a failure is kept in result["errors"] (the other sections still run: a GPU
    is lent briefly). Whether it succeeded."""
    try:
        run()
        return True
    except Exception as error:  # noqa: BLE001 - any failure is a finding to report, not a stop
        result.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"[:4000]
        print(f"{name} failed: {error}", file=sys.stderr, flush=True)
        return False


def kernel_line(row: dict) -> str:
    figures = []
    for name in ("pallas", "xla"):
        if f"{name}_failed" in row:
            figures.append(f"{name} FAILED ({row[f'{name}_failed'].splitlines()[0][:120]})")
        else:
            figures.append(f"{name} {row[f'{name}_ms']:.3f} ms (err {row[f'{name}_max_abs_error']:.1e})")
    if "pallas_over_xla_speed" in row:
        figures.append(f"pallas/xla speed {row['pallas_over_xla_speed']:.2f}x")
    return f"| kernel | {row['shape']} {row['dtype']} {row['batch']} | {', '.join(figures)} |"


def table(result: dict) -> str:
    """What the run measured, one line a case (the sections it ran)."""
    lines = ["| check | case | figures |", "|---|---|---|"]
    tests = result.get("tests")
    if tests is not None and "error" in tests:
        lines.append(f"| gpu tests | {' '.join(GPU_TESTS)} | {tests['error']} |")
    elif tests is not None:
        passed = tests.get("tests", 0) - tests.get("failures", 0) - tests.get("errors", 0) - tests.get("skipped", 0)
        lines.append(f"| gpu tests | {' '.join(GPU_TESTS)} | {passed} passed, {tests.get('failures', 0) + tests.get('errors', 0)} "
                     f"failed, {tests.get('skipped', 0)} not run ({tests['seconds']:.0f} s) |")
    lines += [kernel_line(row) for row in result.get("kernels", [])]
    for name, error in result.get("errors", {}).items():
        lines.append(f"| FAILED | {name} | {error.splitlines()[0][:200]} |")
    for key in ("engine", "engine_xla"):
        info, *rows = result.get(key) or [None]
        for row in rows:
            lines.append(f"| {key} | {result['model']} B={row['batch']} | {row['decode_tok_per_s']:.0f} tok/s, step "
                         f"{row['step_ms']:.2f} ms (host {row['host_ms']:.2f} ms), MBU {100 * row['mbu']:.1f}% |")
        if info is not None:
            lines.append(f"| {key} | warm-up | {info['warm_up_s']:.0f} s, attention {info['attention']}, bandwidth "
                         f"{result['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s from {result['bandwidth_source']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script, measures nothing")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--tests-timeout", type=float, default=240.0, help="seconds allowed for the gpu tests")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--print-gpu-tests", action="store_true",
                        help="print where the gpu tests are (GPU_TESTS, for bench/gpu_run.sh) and exit")
    args = parser.parse_args()
    if args.print_gpu_tests:
        print(*GPU_TESTS)
        return
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    sizes = SMOKE if args.smoke else FULL
    start = time.perf_counter()
    # The tests first, in their own process, before this one starts a backend: a GPU backend takes
    # most of the device's memory at start.
    tests = run_gpu_tests(args.tests_timeout) if "tests" in sections else None
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    if not (on_gpu or args.smoke):
        parser.error(f"no GPU here (jax sees {device.platform}); run with --smoke to check the script on CPU")
    # A smoke run measures nothing worth keeping: its file is git-ignored (*_new.*).
    out = args.out or REPO / "bench" / "results" / ("gpu_check_smoke_new.json" if args.smoke else
                                                     f"gpu_check_{device.platform}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device_kind": device.device_kind, "platform": device.platform, "jax": jax.__version__,
              "smoke": args.smoke, "model": sizes.model.name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "sections": sections}

    def save():
        result["seconds"] = time.perf_counter() - start
        out.write_text(json.dumps(result, indent=2) + "\n")

    def done(name: str):
        save()
        print(f"{name} done at {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    if tests is not None:
        result["tests"] = tests
        done("tests")
    if "kernels" in sections:
        result["kernels"] = []
        section(result, "kernels", lambda: check_kernels(sizes, on_gpu, result["kernels"], save))
        done("kernels")
    if "engine" in sections:
        result["bandwidth_bytes_per_s"], result["bandwidth_source"] = device_bandwidth(device)
        result["engine"] = []
        # The engine with the Pallas kernel (auto); should that fail on a first GPU, the XLA attention
        # still gives the step's figures.
        ran = section(result, "engine", lambda: run_engine(sizes, device, result["bandwidth_bytes_per_s"], "auto",
                                                           result["engine"], save))
        if not (ran or args.smoke):
            result["engine_xla"] = []
            section(result, "engine_xla", lambda: run_engine(sizes, device, result["bandwidth_bytes_per_s"], "xla",
                                                             result["engine_xla"], save))
        done("engine")
    print(table(result))
    print(f"{result['seconds']:.0f} s in all; saved {out}")
    kernel_failed = any(f"{name}_failed" in row for row in result.get("kernels", []) for name in ("pallas", "xla"))
    if result.get("errors") or kernel_failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
