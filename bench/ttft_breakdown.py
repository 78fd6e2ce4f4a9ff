"""Where the predicted and the measured time to first token part: one verifying run of a tune report,
request by request and step by step.

    python bench/ttft_breakdown.py --report tune.json [--rate R] [--out breakdown.json]

Serves the report's settings with bench/trace_server.py (the real server, its engine traced), replays
the report's workload at R (default: the rate the report verified at) and simulates the same requests
with the report's cost model. Per request, the measured TTFT is split at the trace's events:

  send lag     due time -> POST sent (the load generator's own delay)
  intake       POST sent -> the engine thread took the request (HTTP, parsing, the inbox)
  wait         taken -> dispatch of the first step that schedules it (queueing for admission)
  prefill      that dispatch -> the step sampling its first token was collected (its prompt's chunks)
  delivery     collected -> the client read the first token chunk (outputs, event loop, streaming)

and the simulation's into its wait (arrival -> start of the step that first schedules it) and
prefill (the measured and simulated TTFT, TPOT and lag: tuning/report.per_request, as `tune` reports
them). Per step, the measured time (from the previous step's collection, or from its own dispatch
if that came later, to its collection) is set
beside the cost model's price of the very same step (its chunks as the trace recorded them), so
the cost model is checked on the steps the server ran, not on the measured grid's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orca_jax.tuning.cost_model import CostModel  # noqa: E402
from orca_jax.tuning.loadgen import replay, running_server  # noqa: E402
from orca_jax.tuning.report import per_request  # noqa: E402
from orca_jax.tuning.search import Settings, p99, simulate_at  # noqa: E402
from orca_jax.tuning.simulate import SimStep  # noqa: E402
from orca_jax.tuning.tune import prompts_for  # noqa: E402
from orca_jax.tuning.workload import Workload  # noqa: E402

HERE = Path(__file__).resolve().parent


def read_trace(path: Path) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """The trace's add, dispatch, collect and first records, each in the order written."""
    events: dict[str, list[dict]] = {"add": [], "dispatch": [], "collect": [], "first": []}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        events[record["event"]].append(record)
    return events["add"], events["dispatch"], events["collect"], events["first"]


def match_requests(adds: list[dict], measured: list, lengths) -> dict[str, int]:
    """Engine request id -> workload index: the same prompt length, the POST sent closest before the
    handler's arrival time (both on CLOCK_MONOTONIC). Failed requests are matched too, so that the
    add of one the engine took and then failed does not take a served request's place."""
    free = set(range(len(measured)))
    ids = {}
    for add in sorted(adds, key=lambda a: a["arrival"]):
        same = [i for i in free if lengths[i][0] == add["prompt_len"] and lengths[i][1] == add["max_tokens"]]
        if same:
            i = min(same, key=lambda i: abs(add["arrival"] - measured[i].sent_at))
            ids[add["request"]] = i
            free.discard(i)
    return ids


def step_rows(adds: list[dict], dispatches: list[dict], collects: list[dict], start: float, price) -> list[dict]:
    """The steps of the measured run (those dispatched after the first request was taken: the
    warm-up's first runs come before), each priced by the cost model (`price`: SimStep -> seconds);
    times from `start`, the run's start on the trace's clock."""
    t_first_add = min(a["t"] for a in adds)
    steps = []
    for d, c in zip(dispatches, collects):
        if d["t"] < t_first_add:
            continue
        chunks = tuple((start_, n) for _, start_, n, _ in d["chunks"])
        steps.append({"dispatched": d["t"] - start, "collected": c["t"] - start, "waited": c["t"] - c["t0"],
                      "chunks": d["chunks"], "predicted_s": price(SimStep(chunks)),
                      "prefill_tokens": sum(n for _, _, n, _ in d["chunks"] if n > 1),
                      "decodes": sum(1 for _, _, n, _ in d["chunks"] if n == 1)})
    for prev, step in zip(steps, steps[1:]):
        # From the previous step's collection, or from its own dispatch when that came later (a step
        # planned after its predecessor was in: the engine was idle, or held the plan back).
        step["measured_s"] = step["collected"] - max(prev["collected"], step["dispatched"])
    return steps


def request_rows(index: dict[str, int], adds: list[dict], dispatches: list[dict], firsts: list[dict],
                 measured: list, side_by_side: list[dict]) -> tuple[list[dict], list[dict]]:
    """Each served request's measured TTFT split at the trace's events, beside report.per_request's
    row for it (`side_by_side`), in workload order; and each other request (failed, or with no first
    token in the trace) as {index, request: its engine id or None, error}."""
    first_dispatch, first_collect = {}, {f["request"]: f["t"] for f in firsts}
    for d in dispatches:
        for rid, *_ in d["chunks"]:
            first_dispatch.setdefault(rid, d["t"])
    added = {a["request"]: a for a in adds}
    rows, failed = [], []
    for rid, i in index.items():
        m, row = measured[i], side_by_side[i]
        if not m.ok or rid not in first_collect:  # (a first token comes after a dispatch)
            failed.append({"index": i, "request": rid, "error": m.error or "served, but the trace has no first token"})
            continue
        rows.append({"index": i, **row, "intake_s": added[rid]["t"] - m.sent_at,
                     "wait_s": first_dispatch[rid] - added[rid]["t"],
                     "prefill_s": first_collect[rid] - first_dispatch[rid],
                     "delivery_s": m.first_at - first_collect[rid],
                     "sim_prefill_s": row["sim_ttft_s"] - row["sim_wait_s"]})
    matched = set(index.values())
    failed += [{"index": i, "request": None, "error": m.error or "served, but no add event in the trace matched it"}
               for i, m in enumerate(measured) if i not in matched]
    rows.sort(key=lambda row: row["index"])
    failed.sort(key=lambda f: f["index"])
    return rows, failed


def breakdown(report: dict, rate: float, work: Path, num_requests: int | None = None) -> dict:
    w = report["workload"]
    workload = Workload(tuple(map(tuple, w["lengths"][:num_requests])), tuple(w["unit_arrivals"][:num_requests]))
    settings = Settings.from_json(report["settings"])
    model = CostModel.from_json(report["measurement"]["cost_model"])
    prompts = prompts_for(workload, report["measurement"], 0)
    trace = work / "trace.jsonl"
    launcher = (sys.executable, str(HERE / "trace_server.py"))
    with running_server(Path(report["toml"]), work / "server.log", launcher=launcher,
                        env={"ORCA_JAX_TRACE": str(trace)}) as url:
        measured, wall = replay(url, [(p, m) for p, (_, m) in zip(prompts, workload.lengths)], workload.arrivals(rate))
    sim = simulate_at(settings, workload, rate, model)
    adds, dispatches, collects, firsts = read_trace(trace)
    index = match_requests(adds, measured, workload.lengths)
    served = [(m, a) for m, a in zip(measured, workload.arrivals(rate)) if m.ok]
    if not served:
        raise SystemExit(f"every request failed (the first: {measured[0].error}); see {work / 'server.log'}")
    start = served[0][0].scheduled_at - served[0][1]

    price = model.pricer(settings.max_num_seqs, settings.max_num_batched_tokens)
    steps = step_rows(adds, dispatches, collects, start, price)
    rows, failed = request_rows(index, adds, dispatches, firsts, measured, per_request(sim, measured))
    return {"rate_rps": rate, "wall_s": wall, "settings": settings.label,
            "ttft_p99_s": p99([r["ttft_s"] for r in rows]), "sim_ttft_p99_s": p99([r["sim_ttft_s"] for r in rows]),
            "tpot_p99_s": p99([r["tpot_s"] for r in rows if r["tpot_s"] is not None]),
            "sim_tpot_p99_s": p99([r["sim_tpot_s"] for r in rows if r["sim_tpot_s"] is not None]),
            "steps": len(steps), "sim_steps": sim.num_steps, "requests": rows, "failed": failed, "step_trace": steps,
            "sim_step_trace": [{"end_s": st.end_s, "chunks": st.chunks} for st in sim.steps]}


def summarize(out: dict) -> str:
    rows = out["requests"]
    tail = sorted(rows, key=lambda r: -r["ttft_s"])[:max(3, len(rows) // 50)]
    lines = [f"{out['settings']} at {out['rate_rps']:.3f} req/s: TTFT p99 measured {out['ttft_p99_s']:.2f} s, "
             f"simulated {out['sim_ttft_p99_s']:.2f}; TPOT p99 {out['tpot_p99_s']:.3f} / {out['sim_tpot_p99_s']:.3f}; "
             f"steps {out['steps']} / {out['sim_steps']}"]
    parts = ("send_lag_s", "intake_s", "wait_s", "prefill_s", "delivery_s")
    for name, group in (("all", rows), ("TTFT tail", tail)):
        mean = {p: np.mean([r[p] for r in group]) for p in parts}
        lines.append(f"{name:10s} ({len(group)}): measured " + ", ".join(f"{p[:-2]} {v:.3f}" for p, v in mean.items())
                     + f" | simulated wait {np.mean([r['sim_wait_s'] for r in group]):.3f}, prefill "
                       f"{np.mean([r['sim_prefill_s'] for r in group]):.3f}")
    timed = [s for s in out["step_trace"] if "measured_s" in s]
    for name, group in (("decode only", [s for s in timed if s["prefill_tokens"] == 0]),
                        ("with prefill", [s for s in timed if s["prefill_tokens"] > 0])):
        if group:
            measured, predicted = sum(s["measured_s"] for s in group), sum(s["predicted_s"] for s in group)
            lines.append(f"steps {name}: {len(group)}, measured {measured:.1f} s, priced {predicted:.1f} s "
                         f"({predicted / measured - 1:+.0%})")
    failed = out["failed"]
    if failed:
        more = f"; {len(failed) - 5} more in the JSON's failed" if len(failed) > 5 else ""
        lines.append(f"failed: {len(failed)} of {len(rows) + len(failed)} requests, left out of the figures above: "
                     + "; ".join(f"#{f['index']} {f['error']}" for f in failed[:5]) + more)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--rate", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=None, help="replay only the workload's first N requests")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    rate = args.rate or report["predicted"]["rate_rps"]
    with tempfile.TemporaryDirectory(prefix="ttft-breakdown-") as scratch:
        work = args.out.with_suffix("") if args.out else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        out = breakdown(report, rate, work, args.requests)
    print(summarize(out))
    if args.out:
        args.out.write_text(json.dumps(out) + "\n")
        print(f"saved {args.out}")
    return out


if __name__ == "__main__":
    main()
