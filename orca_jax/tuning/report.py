"""What `orca-jax tune` prints and keeps: the candidates' table, predicted against measured figures,
the cost model in one line, the capacity plot, and each candidate as JSON for the report. Importing
this module does not import jax (nor matplotlib: the plot imports it when asked).
"""

from __future__ import annotations

from pathlib import Path

from orca_jax.tuning.cost_model import CostModel
from orca_jax.tuning.search import Outcome, Target


def _fmt(value: float | None, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.3f} {unit}"


def table(outcomes: list[Outcome], target: Target, winner: Outcome | None, rows: int = 12, margin: float = 0.0
          ) -> str:
    """The best candidates, one line each; `margin`: simulated with every step that much dearer."""
    if target.rate is None:
        ranked = sorted(outcomes, key=lambda o: -(o.capacity or 0))
        head = f"{'settings':58s} {'capacity':>10s} {'TTFT p99':>10s} {'TPOT p99':>10s}"
    else:
        ranked = sorted(outcomes, key=lambda o: o.point.score(target))
        head = f"{'settings':58s} {'score':>10s} {'TTFT p99':>10s} {'TPOT p99':>10s}"
    lines = [head]
    shown = set()
    for o in ranked:
        key = o.same_as or o.settings
        if key in shown:
            continue  # a larger KV budget that ran the same
        shown.add(key)
        mark = "*" if winner is not None and (winner.same_as or winner.settings) == key else " "
        first = f"{o.capacity:6.3f} r/s" if target.rate is None else f"{o.point.score(target):10.2f}"
        p = o.point
        lines.append(f"{mark}{key.label:57s} {first:>10s} {_fmt(p and p.ttft_p99_s):>10s} {_fmt(p and p.tpot_p99_s):>10s}")
        if len(lines) > rows:
            break
    dearer = [f"simulated with every step {margin:.0%} dearer than measured (--cost-margin):"] if margin else []
    return "\n".join(dearer + lines)


def side_by_side(predicted: dict, measured: dict | None, target: Target) -> str:
    """Predicted and measured figures of the winner at the chosen rate; error = predicted / measured - 1."""
    rows = [("TTFT p99 (s)", "ttft_p99_s", target.ttft_p99_s, ".3f"), ("TPOT p99 (s)", "tpot_p99_s", target.tpot_p99_s, ".3f"),
            ("rate (req/s)", "rate_rps", None, ".3f"), ("run (s)", "wall_s", None, ".1f"),
            ("iterations", "steps", None, ".0f"), ("preemptions", "preemptions", None, ".0f")]
    lines = [f"{'':14s} {'predicted':>10s} {'measured':>10s} {'error':>8s} {'target':>8s}"]
    for name, key, goal, form in rows:
        p, m = predicted.get(key), (measured or {}).get(key)
        error = f"{p / m - 1:+.0%}" if p is not None and m else "-"
        lines.append(f"{name:14s} {'-' if p is None else format(p, form):>10s} {'-' if m is None else format(m, form):>10s} "
                     f"{error:>8s} {'' if goal is None else format(goal, '.3f'):>8s}")
    return "\n".join(lines)


def per_request(simulated, measured: list | None) -> list[dict]:
    """Each request of the verifying run, simulated and measured side by side (same arrival, same
    lengths), so that a bias in the p99s can be traced to the requests that carry it: the simulated
    queue it joined, wait (arrival to the step that first schedules it), TTFT and TPOT, and the
    measured TTFT and TPOT with the load generator's own lag (the request's due time to its POST).
    `simulated`: the simulation's SimResult at the run's rate; `measured`: loadgen's Measured of
    each request. (bench/ttft_breakdown.py splits the measured TTFT further, from a traced server.)"""
    rows = []
    requests = simulated.requests
    for i, r in enumerate(requests):
        # The queue it joined: requests that arrived before it and were not yet scheduled.
        queue = sum(1 for q in requests[:i] if q.scheduled_s > r.arrival_s)
        row = {"prompt_len": r.prompt_len, "max_tokens": r.max_tokens, "arrival_s": r.arrival_s,
               "sim_queue_at_arrival": queue,
               "sim_wait_s": r.scheduled_s - r.arrival_s, "sim_ttft_s": r.first_token_s - r.arrival_s,
               "sim_tpot_s": (r.finish_s - r.first_token_s) / (r.max_tokens - 1) if r.max_tokens > 1 else None}
        m = measured[i] if measured else None
        if m is not None and m.ok:
            row.update(ttft_s=m.ttft_s, tpot_s=None if m.output_tokens < 2 else m.tpot_s,
                       output_tokens=m.output_tokens, send_lag_s=m.sent_at - m.scheduled_at)
        rows.append(row)
    return rows


def plot(outcomes: list[Outcome], target: Target, path: Path, margin: float = 0.0) -> str:
    """Capacity (or, at a fixed rate, the p99 score) against max_num_seqs, one panel per policy and a
    line per token budget, at the best KV budget of each; `margin`: the capacities are with every
    step that much dearer than measured. Returns what was done, for the log."""
    try:
        import matplotlib
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'orca-jax[bench]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def value(o: Outcome) -> float:
        return (o.capacity or 0.0) if target.rate is None else o.point.score(target)

    policies = sorted({o.settings.policy for o in outcomes})
    fig, axes = plt.subplots(1, len(policies), figsize=(3.6 * len(policies), 3.2), dpi=90, sharey=True, squeeze=False)
    for ax, policy in zip(axes[0], policies):
        budgets = sorted({o.settings.max_num_batched_tokens for o in outcomes if o.settings.policy == policy})
        for tokens in budgets:
            best: dict[int, float] = {}
            for o in outcomes:
                s = o.settings
                if s.policy == policy and s.max_num_batched_tokens == tokens:
                    pick = max if target.rate is None else min
                    best[s.max_num_seqs] = pick(best.get(s.max_num_seqs, value(o)), value(o))
            seqs = sorted(best)
            ax.plot(seqs, [best[s] for s in seqs], "o-", label=f"{tokens} tokens")
        ax.set(xscale="log", xlabel="max_num_seqs", title=policy)
        ax.set_xticks(sorted({o.settings.max_num_seqs for o in outcomes}),
                      [str(s) for s in sorted({o.settings.max_num_seqs for o in outcomes})])
        ax.minorticks_off()
        ax.legend(fontsize=7, title="max_num_batched_tokens", title_fontsize=7)
    axes[0][0].set_ylabel("capacity (req/s within the target)" if target.rate is None
                          else f"p99 / target at {target.rate:g} req/s (lower is better)")
    dearer = f", every step {margin:.0%} dearer than measured" if margin else ""
    fig.suptitle(f"simulated{dearer}: TTFT p99 <= {target.ttft_p99_s:g} s, TPOT p99 <= {target.tpot_p99_s:g} s",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"plot: {path}"


def grouped(refused: list[tuple[str, str]]) -> dict[str, list[str]]:
    """The refused settings by reason, in order."""
    groups: dict[str, list[str]] = {}
    for what, why in refused:
        groups.setdefault(why, []).append(what)
    return groups


def summary(model: CostModel) -> str:
    """The cost model in one line: the step time at the smallest and largest buckets, the shared terms, the fit."""
    def ms(seconds: float) -> str:
        return f"{1000 * seconds:.{1 if seconds < 0.1 else 0}f} ms"

    def ends(table: dict[int, float], unit: str) -> str:
        lo, hi = min(table), max(table)
        return f"{ms(table[lo])} at {lo} {unit} .. {ms(table[hi])} at {hi}"

    errors = model.fit_error
    return (f"decode {ends(model.decode_base_s, 'sequences')} + {1000 * model.decode_per_1k_attended_s:.2f} ms per "
            f"1k positions attended; prefill {ends(model.prefill_base_s, 'tokens')} + "
            f"{1000 * model.prefill_per_seq_s:.2f} ms per sequence + {1000 * model.prefill_per_1k_attended_s:.2f} ms "
            f"per 1k attended; host {1000 * model.host_s_per_step:.1f} ms per step + "
            f"{1000 * model.host_s_per_seq:.2f} ms per sequence; fit rms error decode "
            f"{errors['decode']['rms_relative']:.0%}, prefill {errors['prefill']['rms_relative']:.0%}")


def outcome_json(o: Outcome) -> dict:
    return {"settings": o.settings.label, "capacity_rps": o.capacity,
            "point": o.point.to_json() if o.point else None, "kv_pages_ran_short": o.kv_bound,
            "same_runs_as": o.same_as.label if o.same_as else None}
