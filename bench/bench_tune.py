"""`orca-jax tune` against its targets: its run time, its predictions, and the capacity it buys.

    python bench/bench_tune.py --slo-ttft-p99 4 --slo-tpot-p99 0.25 [--tune-report R.json] [tune flags ...]

1. Runs `orca-jax tune` (timed whole, the verifying run included) on the tuning workload: its
   distributions (--prompt-len-dist, --output-len-dist, --num-requests) with seed 0. With
   --tune-report, an earlier run's report and TOML are used instead.
2. Draws a held-out workload: the same distributions (Poisson arrivals, heavy-tailed prompts and
   outputs by default), another seed.
3. Measures, on real servers (tuning/loadgen.py), the capacity of the default settings
   (configs/engine/default.toml's: chunked, 32 sequences, 512 tokens, the default KV) and of the
   tuned ones on the held-out workload: the largest arrival rate whose p99 TTFT and TPOT meet the
   target, found by probing rates (each probe replays the whole workload) from the simulation's
   estimate up and down by --step, then bisecting --bisections times between the highest rate met
   and the lowest missed above it.

Saves bench/results/tune_new.json (or --out): the tune run's time and report (with each request of
its verifying run, simulated and measured side by side), each probe, both capacities and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

from orca_jax.tuning.cost_model import CostModel  # noqa: E402
from orca_jax.tuning.loadgen import replay, running_server  # noqa: E402
from orca_jax.tuning.search import Settings, Target, find_capacity, p99  # noqa: E402
from orca_jax.tuning.tune import length_dist, prompts_for  # noqa: E402
from orca_jax.tuning.workload import WorkloadSpec, describe, workload_of_spec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = {"policy": "chunked", "max_num_seqs": 32, "max_num_batched_tokens": 512}  # configs/engine/default.toml


def probe(url: str, workload, prompts, rate: float, target: Target) -> dict:
    results, wall = replay(url, [(p, m) for p, (_, m) in zip(prompts, workload.lengths)], workload.arrivals(rate))
    ok = [r for r in results if r.ok]
    row = {"rate_rps": rate, "ok": len(ok), "requests": len(results), "wall_s": wall,
           "ttft_p99_s": p99([r.ttft_s for r in ok]),
           "tpot_p99_s": p99([r.tpot_s for r in ok if not math.isnan(r.tpot_s)])}
    row["meets"] = (row["ok"] == row["requests"] and row["ttft_p99_s"] <= target.ttft_p99_s
                    and row["tpot_p99_s"] <= target.tpot_p99_s)
    print(f"  {rate:6.3f} req/s: TTFT p99 {row['ttft_p99_s']:6.2f} s, TPOT p99 {row['tpot_p99_s']:.3f} s, "
          f"ok {row['ok']}/{row['requests']} -> {'meets' if row['meets'] else 'misses'}", flush=True)
    return row


def measured_capacity(toml: Path, workload, prompts, target: Target, start: float, step: float, bisections: int,
                      log: Path) -> dict:
    """Probes from `start` up (or down) by `step` until the answer changes, then bisects `bisections` times."""
    probes = []
    with running_server(toml, log) as url:
        rate = start
        first = probe(url, workload, prompts, rate, target)
        probes.append(first)
        direction = step if first["meets"] else 1 / step
        while True:
            rate *= direction
            probes.append(probe(url, workload, prompts, rate, target))
            if probes[-1]["meets"] != first["meets"] or len(probes) > 6:
                break
        for _ in range(bisections):
            met = [p["rate_rps"] for p in probes if p["meets"]]
            above = [p["rate_rps"] for p in probes if not p["meets"] and met and p["rate_rps"] > max(met)]
            if not (met and above):
                break
            probes.append(probe(url, workload, prompts, math.sqrt(max(met) * min(above)), target))
    return {"capacity_rps": max((p["rate_rps"] for p in probes if p["meets"]), default=0.0), "probes": probes}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--slo-ttft-p99", type=float, required=True)
    parser.add_argument("--slo-tpot-p99", type=float, required=True)
    parser.add_argument("--prompt-len-dist", default="zipf:32:1024")
    parser.add_argument("--output-len-dist", default="zipf:16:256")
    parser.add_argument("--num-requests", type=int, default=200, help="requests of the tuning workload")
    parser.add_argument("--heldout-requests", type=int, default=120, help="requests of the held-out workload")
    parser.add_argument("--heldout-seed", type=int, default=1)
    parser.add_argument("--step", type=float, default=1.25, help="factor between probed rates")
    parser.add_argument("--bisections", type=int, default=2, help="probes between the bracketing rates")
    parser.add_argument("--tune-report", type=Path, help="an earlier tune report (its TOML beside it) instead of tuning")
    parser.add_argument("--out", type=Path, default=RESULTS / "tune_new.json")
    args, tune_flags = parser.parse_known_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.out.with_suffix("")
    work.mkdir(exist_ok=True)

    tune_s = None
    report_path = args.tune_report or work / "tune.json"
    if args.tune_report is None:
        command = [sys.executable, "-m", "orca_jax.cli", "tune", "--model", args.model,
                   "--slo-ttft-p99", str(args.slo_ttft_p99), "--slo-tpot-p99", str(args.slo_tpot_p99),
                   "--prompt-len-dist", args.prompt_len_dist, "--output-len-dist", args.output_len_dist,
                   "--num-requests", str(args.num_requests), "--out", str(work / "tuned.toml"),
                   "--report", str(report_path), *tune_flags]
        print("$", " ".join(command), flush=True)
        start = time.perf_counter()
        subprocess.run(command, check=True)
        tune_s = time.perf_counter() - start
    report = json.loads(report_path.read_text())
    tuned_toml = Path(report["toml"])

    target = Target(args.slo_ttft_p99, args.slo_tpot_p99)
    (pdist, plo, phi, palpha), (odist, olo, ohi, _) = length_dist(args.prompt_len_dist), length_dist(args.output_len_dist)
    heldout = workload_of_spec(WorkloadSpec(num_requests=args.heldout_requests, prompt_dist=pdist, prompt_len=(plo, phi),
                                            output_dist=odist, output_len=(olo, ohi), zipf_alpha=palpha,
                                            arrival="poisson", rate=1.0, seed=args.heldout_seed))
    prompts = prompts_for(heldout, report["measurement"], args.heldout_seed)
    print(f"held-out workload: {describe(list(heldout.lengths))}", flush=True)

    model = CostModel.from_json(report["measurement"]["cost_model"])
    defaults_toml = work / "defaults.toml"
    defaults_toml.write_text(f'model = "{report["model"]}"\n')
    pages = report["measurement"]["kv_pages"]
    default_pages = pages.get(str(1 << 30)) if isinstance(pages.get(str(1 << 30)), int) else None
    tuned = Settings.from_json(report["settings"])
    candidates = {
        "defaults": (defaults_toml, dataclasses.replace(tuned, **DEFAULTS, kv_cache_memory=1 << 30,
                                                        num_pages=default_pages or tuned.num_pages)),
        "tuned": (tuned_toml, tuned),
    }
    results = {}
    for name, (toml, settings) in candidates.items():
        predicted = find_capacity(settings, heldout, model, target).capacity
        print(f"{name}: {settings.label}, simulated capacity {predicted:.3f} req/s; measuring ...", flush=True)
        results[name] = {"settings": settings.label, "predicted_capacity_rps": predicted,
                         **measured_capacity(toml, heldout, prompts, target, predicted, args.step, args.bisections,
                                             work / f"{name}.server.log")}
        print(f"{name}: measured capacity {results[name]['capacity_rps']:.3f} req/s", flush=True)
    ratio = results["tuned"]["capacity_rps"] / results["defaults"]["capacity_rps"] \
        if results["defaults"]["capacity_rps"] else math.inf
    print(f"tuned / defaults capacity on the held-out workload: {ratio:.2f}x; tune took "
          f"{'-' if tune_s is None else f'{tune_s:.0f} s'}")
    out = {"machine": machine.describe(), "model": args.model, "target": {"ttft_p99_s": target.ttft_p99_s,
                                                                         "tpot_p99_s": target.tpot_p99_s},
           "tune_s": tune_s, "tune_predicted": report["predicted"], "tune_measured": report["measured"],
           "tune_nominal_capacity_rps": report.get("nominal_capacity_rps"),
           "tune_cost_margin": report.get("cost_margin"),
           "tune_per_request": report.get("per_request"),
           "tune_settings": report["settings"], "heldout": describe(list(heldout.lengths)),
           "capacity": results, "capacity_ratio": ratio}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"saved {args.out}")
    return out


if __name__ == "__main__":
    main()
