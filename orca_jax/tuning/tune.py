"""`orca-jax tune`: serving settings for a latency target, chosen from a measured cost model and
checked by one real run.

    orca-jax tune --model M --slo-ttft-p99 S --slo-tpot-p99 S
                  [--workload FILE | --prompt-len-dist D --output-len-dist D] [--arrival-rate R | --max-rate]
                  [--out tuned.toml] [--report tune.json]

1. Measure (a process of its own: tuning/measure.py): the engine is built once with the largest
   limits searched, its step time timed over a grid of shapes and fitted (tuning/cost_model.py),
   and the memory plan gives each KV budget's pages.
2. Search (tuning/search.py): every policy x max_num_seqs x max_num_batched_tokens x KV budget the
   memory plan allows, simulated against the workload (tuning/simulate.py): the largest arrival
   rate whose p99 TTFT and TPOT meet the targets with every step --cost-margin dearer than
   measured (--max-rate, the default: the recommended rate; the nominal capacity, at the measured
   costs, is printed beside it), or the best p99s at --arrival-rate.
3. Write the winner as an engine TOML (`orca-jax serve --config` takes it), then verify it: start
   that server, replay the workload at the recommended (or given) rate (tuning/loadgen.py), and
   print the p99s predicted there at the measured costs and the measured ones side by side; the
   report JSON keeps both, the settings, the cost model and every candidate; a plot shows capacity
   against each setting (the printed and kept pieces: tuning/report.py).

Importing this module does not import jax: cli.py builds its parser at start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orca_jax.config import DEFAULT_MODEL, DTYPE_CHOICES, QUANTIZATION_CHOICES, SCHEDULING_POLICIES
from orca_jax.sizes import byte_size, format_bytes
from orca_jax.tuning.cost_model import CostModel
from orca_jax.tuning.report import grouped, outcome_json, per_request, plot, side_by_side, summary, table
from orca_jax.tuning.search import (DEFAULT_COST_MARGIN, Space, Target, find_capacity, p99, search, sensitivity,
                                    simulate_at, speed_of_run)
from orca_jax.tuning.workload import (LENGTH_DISTRIBUTIONS, Workload, WorkloadSpec, describe, load_jsonl,
                                      workload_of_requests, workload_of_spec)


# ---- arguments ---------------------------------------------------------------------------

def length_dist(text: str) -> tuple[str, int, int, float]:
    """`zipf:LO:HI[:ALPHA]`, `uniform:LO:HI` or `equal:N`, as (distribution, lo, hi, alpha)."""
    parts = text.split(":")
    try:
        if parts[0] == "equal" and len(parts) == 2:
            return "equal", int(parts[1]), int(parts[1]), 1.0
        if parts[0] in LENGTH_DISTRIBUTIONS and len(parts) in (3, 4) and (parts[0] == "zipf" or len(parts) == 3):
            lo, hi = int(parts[1]), int(parts[2])
            if 1 <= lo <= hi:
                return parts[0], lo, hi, float(parts[3]) if len(parts) == 4 else 1.0
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: give zipf:LO:HI[:ALPHA], uniform:LO:HI or equal:N, with 1 <= LO <= HI "
                                     "tokens (e.g. zipf:32:1024)")


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.replace(",", " ").split())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas, e.g. 8,16,32")
    return values


def size_list(text: str) -> tuple[int, ...]:
    values = tuple(byte_size(v) for v in text.replace(",", " ").split())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes separated by commas, e.g. 512MiB,1GiB")
    return values


def cost_margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"{text!r}: give a fraction >= 0, e.g. 0.1 for every step 10% dearer")
    return value


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    space = Space()
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"preset name, checkpoint directory or .gguf file (default {DEFAULT_MODEL})")
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="tokens per sequence (default: the model's context length); the memory plan holds every "
                             "KV budget to at least one such sequence")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    target = parser.add_argument_group("latency target")
    target.add_argument("--slo-ttft-p99", type=float, required=True, metavar="S",
                        help="seconds: the 99th percentile of time to first token may not exceed this")
    target.add_argument("--slo-tpot-p99", type=float, required=True, metavar="S",
                        help="seconds: the 99th percentile of time per output token (after the first) may not exceed this")
    rate = target.add_mutually_exclusive_group()
    rate.add_argument("--arrival-rate", type=float, metavar="R", help="requests/s: the settings with the best p99s at R")
    rate.add_argument("--max-rate", action="store_true",
                      help="the settings that serve the largest arrival rate within the target (the default)")
    target.add_argument("--cost-margin", type=cost_margin, default=None, metavar="M",
                        help=f"--max-rate: recommend the largest rate that meets the target with every step M "
                             f"(a fraction) dearer than measured, so that it holds when the machine runs slower "
                             f"than it was measured (default {DEFAULT_COST_MARGIN:g}; 0: the nominal capacity)")
    work = parser.add_argument_group("workload (a file, or distributions; Poisson arrivals unless --arrival-cv)")
    work.add_argument("--workload", type=Path, metavar="FILE",
                      help="JSONL, one request a line: prompt_token_ids, max_tokens[, arrival_s] (bench/workloads.py "
                           "writes it); its arrival pattern is kept and stretched to each rate tried")
    work.add_argument("--prompt-len-dist", type=length_dist, default=length_dist("zipf:32:1024"), metavar="DIST",
                      help="prompt tokens: zipf:LO:HI[:ALPHA] (heavy-tailed), uniform:LO:HI or equal:N "
                           "(default zipf:32:1024)")
    work.add_argument("--output-len-dist", type=length_dist, default=length_dist("zipf:16:256"), metavar="DIST",
                      help="generated tokens per request, as --prompt-len-dist (default zipf:16:256)")
    work.add_argument("--num-requests", type=int, default=200, help="requests in the workload (default 200)")
    work.add_argument("--arrival-cv", type=float, default=1.0,
                      help="coefficient of variation of the gaps between arrivals: 1 is Poisson (default), above 1 "
                           "burstier (gamma)")
    work.add_argument("--seed", type=int, default=0)
    search_args = parser.add_argument_group("search space")
    search_args.add_argument("--policies", nargs="+", choices=SCHEDULING_POLICIES, default=list(space.policies))
    search_args.add_argument("--max-num-seqs", type=int_list, default=space.max_num_seqs, metavar="LIST",
                             help=f"default {','.join(map(str, space.max_num_seqs))}")
    search_args.add_argument("--max-num-batched-tokens", type=int_list, default=space.max_num_batched_tokens,
                             metavar="LIST", help="token budget per step, also the chunked policy's prompt chunk "
                                                  f"(default {','.join(map(str, space.max_num_batched_tokens))})")
    search_args.add_argument("--kv-cache-memory", type=size_list, default=space.kv_cache_memory, metavar="LIST",
                             help="KV budgets per device, e.g. 256MiB,1GiB (default 64MiB to 4GiB, doubling); the "
                                  "memory plan refuses those that do not fit")
    search_args.add_argument("--device-memory", type=byte_size, default=None,
                             help="memory per device for the memory plan (default: what JAX reports for an "
                                  "accelerator, the host's memory on CPU)")
    run = parser.add_argument_group("measuring and verifying")
    run.add_argument("--measure-seconds", type=float, default=30.0,
                     help="time for the step-time rounds (at least three rounds are taken; default 30)")
    run.add_argument("--cost-model", type=Path, default=None, metavar="JSON",
                     help="reuse the measurement of an earlier --report (same model, machine and limits) instead "
                          "of measuring")
    run.add_argument("--no-verify", action="store_true", help="skip the real run (predictions only)")
    run.add_argument("--out", type=Path, default=Path("tuned.toml"),
                     help="the chosen settings, for `orca-jax serve --config` (default tuned.toml)")
    run.add_argument("--report", type=Path, default=None, help="JSON: predicted and measured p99s, settings, cost model, "
                                                               "candidates")
    run.add_argument("--plot", type=Path, default=None,
                     help="PNG of capacity against each setting (default: beside --report, else tune.png; needs "
                          "matplotlib)")


def workload_from_args(args: argparse.Namespace) -> Workload:
    if args.workload is not None:
        return workload_of_requests(load_jsonl(args.workload), seed=args.seed)
    (pdist, plo, phi, palpha), (odist, olo, ohi, oalpha) = args.prompt_len_dist, args.output_len_dist
    if pdist == "zipf" and odist == "zipf" and palpha != oalpha:
        raise ValueError("give prompts and outputs the same zipf exponent (one WorkloadSpec alpha)")
    alpha = palpha if pdist == "zipf" else oalpha
    spec = WorkloadSpec(num_requests=args.num_requests, prompt_dist=pdist, prompt_len=(plo, phi), output_dist=odist,
                        output_len=(olo, ohi), zipf_alpha=alpha,
                        arrival="poisson" if args.arrival_cv == 1 else "gamma", cv=args.arrival_cv, rate=1.0,
                        seed=args.seed)
    return workload_of_spec(spec)


# ---- the settings file ---------------------------------------------------------------------

def settings_toml(args: argparse.Namespace, settings, header: list[str]) -> str:
    """An EngineConfig TOML (`serve --config`): the model flags given to tune, then the chosen settings."""
    def quoted(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [f"# {line}" for line in header] + [f"model = {quoted(str(args.model))}"]
    if args.quantization != "auto":
        lines.append(f"quantization = {quoted(args.quantization)}")
    if args.dtype != "auto":
        lines.append(f"dtype = {quoted(args.dtype)}")
    if args.max_model_len is not None:
        lines.append(f"max_model_len = {args.max_model_len}")
    lines += ["", "[cache]", f"page_size = {settings.page_size}"]
    if settings.kv_cache_memory is not None:
        lines.append(f"kv_cache_memory = {settings.kv_cache_memory}  # {format_bytes(settings.kv_cache_memory)}")
    lines += ["", "[scheduler]", f"policy = {quoted(settings.policy)}",
              f"max_num_seqs = {settings.max_num_seqs}",
              f"max_num_batched_tokens = {settings.max_num_batched_tokens}"]
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class _Limits:
    """The measuring engine's settings: the largest limits searched, the engine's default KV budget."""

    policy: str
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    kv_cache_memory: int | None = None


# ---- the steps -------------------------------------------------------------------------------

def measure(args: argparse.Namespace, space: Space, work: Path) -> dict:
    """The cost model and the KV budgets' pages, from a measuring process (tuning/measure.py)."""
    if args.cost_model is not None:
        measured = json.loads(args.cost_model.read_text())
        measured = measured.get("measurement", measured)  # a whole report, or the measurement alone
        missing = [str(kv) for kv in space.kv_cache_memory if str(kv) not in measured["kv_pages"]]
        if missing:
            raise ValueError(f"{args.cost_model} has no memory plan for the KV budgets {missing}; measure again "
                             "(leave out --cost-model)")
        return measured
    # The largest limits searched (so every bucket a candidate uses is among those measured), and
    # the engine's default KV budget: the timings reuse pages, so they need no more.
    config = work / "measure.toml"
    largest = _Limits("chunked", max(space.max_num_seqs), max(space.max_num_batched_tokens), args.page_size)
    config.write_text(settings_toml(args, largest, ["the tuner's measuring engine"]))
    out = work / "measurement.json"
    command = [sys.executable, "-m", "orca_jax.tuning.measure", "--config", str(config),
               "--budget-s", str(args.measure_seconds), "--out", str(out),
               "--kv-cache-memory", *map(str, space.kv_cache_memory)]
    if args.device_memory:
        command += ["--device-memory", str(args.device_memory)]
    if subprocess.run(command).returncode != 0:
        raise RuntimeError("measuring the step times failed (its output is above)")
    return json.loads(out.read_text())


def prompts_for(workload: Workload, measurement: dict, seed: int) -> list[list[int]]:
    """The workload's own prompts, or seeded token ids of its lengths (prefix caching is off, so
    content does not change a step's cost), avoiding the model's special tokens."""
    if workload.prompt_token_ids is not None:
        return [list(p) for p in workload.prompt_token_ids]
    special = set(measurement["special_token_ids"])
    allowed = [t for t in range(min(measurement["vocab_size"], 32000)) if t not in special]
    rng = random.Random(f"prompts-{seed}")
    return [[rng.choice(allowed) for _ in range(p)] for p, _ in workload.lengths]


def verify(toml: Path, workload: Workload, prompts: list[list[int]], rate: float, log: Path,
           expected_s: float) -> tuple[list, dict]:
    """The settings served for real at `rate`: each request's measurement (loadgen.Measured) and the
    p99s measured from the streamed responses. `expected_s`: the simulated run's length, for the log."""
    from tqdm.auto import tqdm

    from orca_jax.tuning.loadgen import engine_counters, replay, running_server

    print(f"verifying: starting `orca-jax serve --config {toml}` (log: {log}) for a replay of about "
          f"{expected_s / 60:.1f} min (--no-verify skips it) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with running_server(toml, log) as url:
        ready = time.perf_counter() - start
        bar = tqdm(total=len(prompts), desc=f"replaying at {rate:.3g} req/s", unit="req")
        before = engine_counters(url)
        results, wall = replay(url, [(p, m) for p, (_, m) in zip(prompts, workload.lengths)],
                               workload.arrivals(rate), progress=lambda: bar.update(1))
        after = engine_counters(url)
        bar.close()
    ok = [r for r in results if r.ok]
    errors = sorted({r.error for r in results if not r.ok})[:5]
    return results, {"rate_rps": rate, "ttft_p99_s": p99([r.ttft_s for r in ok]),
            "tpot_p99_s": p99([r.tpot_s for r in ok if not math.isnan(r.tpot_s)]),
            "requests": len(results), "ok": len(ok), "errors": errors, "wall_s": wall,
            "throughput_rps": len(ok) / wall, "server_ready_s": ready,
            **{key: after[key] - before.get(key, 0.0) for key in after}}


# ---- the command -----------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    from tqdm.auto import tqdm

    started = time.perf_counter()
    target = Target(args.slo_ttft_p99, args.slo_tpot_p99, args.arrival_rate)
    if target.rate is not None and args.cost_margin is not None:
        raise ValueError("--cost-margin sets the margin under which --max-rate recommends a rate; at a given "
                         "--arrival-rate there is no rate to choose: drop one of the two")
    # --max-rate: the rate recommended meets the target with every step `margin` dearer (search.py).
    margin = None if target.rate is not None else DEFAULT_COST_MARGIN if args.cost_margin is None else args.cost_margin
    space = Space(tuple(args.policies), tuple(args.max_num_seqs), tuple(args.max_num_batched_tokens),
                  tuple(args.kv_cache_memory))
    workload = workload_from_args(args)
    print(f"workload: {describe(list(workload.lengths))}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="orca-jax-tune-") as scratch:
        measurement = measure(args, space, Path(scratch))
    model = CostModel.from_json(measurement["cost_model"])
    if workload.max_request_len > measurement["max_model_len"]:
        raise ValueError(f"the workload's longest request has {workload.max_request_len} tokens (prompt + output), "
                         f"more than max_model_len={measurement['max_model_len']}: shorten it or raise --max-model-len")
    measured_s = time.perf_counter() - started
    print(f"cost model ({measured_s:.0f} s): {summary(model)}", file=sys.stderr)

    def pages_for(kv: int) -> int:
        from orca_jax.config import ConfigError

        answer = measurement["kv_pages"][str(kv)]
        if isinstance(answer, str):
            raise ConfigError(answer)
        return answer

    def progress(items):
        return tqdm(items, desc="searching", unit="setting")

    searched = model if margin is None else model.scaled(1 + margin)
    winner, outcomes, refused = search(space, workload, searched, target, pages_for, measurement["page_size"],
                                       progress)
    for why, what in grouped(refused).items():
        print(f"refused {', '.join(what) if len(what) <= 3 else f'{len(what)} settings ({what[0]}, ...)'}: {why}",
              file=sys.stderr)
    if not outcomes:
        raise ValueError("the memory plan and the workload leave no settings to try (see the refusals above)")
    print(table(outcomes, target, winner, margin=margin or 0.0))
    if winner is None:
        raise ValueError(f"no settings meet TTFT p99 <= {target.ttft_p99_s} s and TPOT p99 <= {target.tpot_p99_s} s "
                         "even at a trickle of requests: loosen the target or shorten the workload's requests")
    settings = winner.settings
    rate = target.rate if target.rate is not None else winner.capacity
    # The nominal capacity, bisected above the recommended rate (which the measured costs meet,
    # unless the simulated p99s fall with the rate there: the prediction below then says so).
    nominal = (None if margin is None else rate if margin == 0
               else find_capacity(settings, workload, model, target, best=rate).capacity)
    # The prediction at the rate served, at the measured costs (with a margin, the search priced its
    # runs dearer); its requests are also per_request's simulated columns.
    simulated = simulate_at(settings, workload, rate, model)
    ttft, tpot = p99(simulated.ttft_s()), p99(simulated.tpot_s())
    predicted = {"rate_rps": rate, "ttft_p99_s": ttft, "tpot_p99_s": tpot,
                 "meets_target": ttft <= target.ttft_p99_s and tpot <= target.tpot_p99_s,
                 "steps": simulated.num_steps, "preemptions": simulated.num_preemptions, "wall_s": simulated.end_s}
    rates = (f"recommended rate {rate:.3g} req/s (it meets the target with every step {margin:.0%} dearer than "
             f"measured; nominal capacity {nominal:.3g} req/s)" if margin is not None else f"{rate:.3g} req/s")
    print(rates, file=sys.stderr)
    if nominal is not None and rate < nominal / 2:
        print(f"the recommended rate is {rate / nominal:.0%} of the nominal capacity: near this target the p99s grow "
              "fast with the step cost (the sensitivity line below); a looser target, a quieter or faster machine or "
              "a smaller --cost-margin leaves more room", file=sys.stderr)
    header = [f"orca-jax tune, {datetime.date.today()}: {describe(list(workload.lengths))}",
              f"target TTFT p99 <= {target.ttft_p99_s} s, TPOT p99 <= {target.tpot_p99_s} s; {rates}",
              f"predicted there: TTFT p99 {ttft:.3f} s, TPOT p99 {tpot:.3f} s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(settings_toml(args, settings, header))
    print(f"settings: {settings.label} -> {args.out}", file=sys.stderr)
    measured = results = None
    if not args.no_verify:
        log = (args.report or args.out).with_suffix(".server.log")
        results, measured = verify(args.out, workload, prompts_for(workload, measurement, args.seed), rate, log,
                                   simulated.end_s)
        measured["meets_target"] = (measured["ok"] == measured["requests"] and measured["ttft_p99_s"] <= target.ttft_p99_s
                                    and measured["tpot_p99_s"] <= target.tpot_p99_s)
        if measured["errors"]:
            print(f"failed requests in the real run: {measured['errors']}", file=sys.stderr)
    spread = margin or DEFAULT_COST_MARGIN
    predicted["step_cost_sensitivity"] = sensitivity(settings, workload, rate, model, spread)
    low, high = predicted["step_cost_sensitivity"].values()
    print(side_by_side(predicted, measured, target))
    print(f"with every step {spread:.0%} cheaper / dearer: TTFT p99 {low['ttft_p99_s']:.3f} / {high['ttft_p99_s']:.3f} "
          f"s, TPOT p99 {low['tpot_p99_s']:.3f} / {high['tpot_p99_s']:.3f} s")
    steps = (measured or {}).get("steps")
    scale = speed_of_run(settings, workload, rate, model, int(steps)) if steps else None
    if steps and scale is None:
        print(f"the run's {steps:.0f} iterations match no step cost between 0.5x and 2x the measured one")
    elif scale is not None:
        at = simulate_at(settings, workload, rate, model.scaled(scale))
        predicted["at_run_speed"] = {"step_scale": scale, "ttft_p99_s": p99(at.ttft_s()), "tpot_p99_s": p99(at.tpot_s())}
        beyond = (f", beyond the {margin:.0%} margin the rate was chosen under"
                  if margin is not None and scale > 1 + margin else "")
        print(f"the run's {measured['steps']:.0f} iterations match steps {scale:.2f}x their measured cost{beyond}; at "
              f"that speed the simulation predicts TTFT p99 {predicted['at_run_speed']['ttft_p99_s']:.3f} s, TPOT p99 "
              f"{predicted['at_run_speed']['tpot_p99_s']:.3f} s")
    plot_path = args.plot or (args.report.with_suffix(".png") if args.report else Path("tune.png"))
    print(plot(outcomes, target, plot_path, margin or 0.0), file=sys.stderr)
    report = {
        "settings": settings.to_json(), "predicted": predicted, "measured": measured,
        # --max-rate: predicted["rate_rps"] is the recommended rate, the largest meeting the target
        # with every step cost_margin dearer; the nominal capacity meets it at the measured costs.
        "nominal_capacity_rps": nominal, "cost_margin": margin,
        "per_request": per_request(simulated, results),
        "target": {"ttft_p99_s": target.ttft_p99_s, "tpot_p99_s": target.tpot_p99_s, "arrival_rate_rps": target.rate},
        "workload": {"description": describe(list(workload.lengths)), "file": str(args.workload or ""),
                     "lengths": workload.lengths, "unit_arrivals": workload.unit_arrivals},
        "model": str(args.model), "quantization": args.quantization, "toml": str(args.out),
        "measurement": measurement,
        "candidates": [outcome_json(o) for o in outcomes],
        "refused": [{"settings": what, "reason": why} for what, why in refused],
        "elapsed_s": time.perf_counter() - started,
    }
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=1) + "\n")
    print(f"tune took {report['elapsed_s']:.0f} s", file=sys.stderr)
    return report


def tune_command(args: argparse.Namespace) -> int:
    """The CLI's entry: prints `error: ...` and returns 2 for what a user can fix."""
    try:
        run(args)
    except (ValueError, OSError, RuntimeError) as error:  # ConfigError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0

