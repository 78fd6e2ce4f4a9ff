"""Speculative decoding: speculation off vs n-gram drafts vs a draft model, one stream and 16 at
once, on a copy-heavy workload (answers that repeat their prompt) and on the `throughput` workload.

    python bench/bench_spec.py [--num-requests 9] [--throughput-requests 32] [--draft-model NAME]
                               [--modes off,ngram,draft_model] [--cases copy1,copy16,throughput16]
                               [--num-speculative-tokens 4] [--prompt-lookup-min 1]
                               [--matmul-impl auto|native|xla]
                               [--out bench/results/spec_new.json]

Every engine runs the same greedy requests (outputs must be identical, token for token; the JSON
records whether they were); the figures are generated tok/s (prefills included), decoding tok/s
(each request's tokens after its first over the time between them: what speculation speeds up), the
ratios of each method to off (within this run), the acceptance (drafts accepted / verified, mean tokens per verifying step), and
the step-time cost of the extra rows (one decode with 0..k drafts, and 16 decodes with 0 or k
drafts each, timed on the runner, proposing included). The draft model defaults to the target
itself (no smaller model with SmolLM2's tokenizer is at hand offline): its drafts are all accepted,
but each costs a draft forward pass as dear as the target's, so it cannot be faster; it measures
the method's overhead. Prints one line per case, saves the JSON and a plot beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from workloads import copy_heavy_workload, mixed_workload  # noqa: E402

from orca_jax import LLM, SamplingParams  # noqa: E402
from orca_jax.config import MATMUL_IMPL_CHOICES, SchedulerConfig, SpeculativeConfig  # noqa: E402
from orca_jax.engine.engine import LLMEngine  # noqa: E402
from orca_jax.engine.step_plan import padding_plan  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CASES = ("copy1", "copy16", "throughput16")
DEFAULTS = SpeculativeConfig()  # k and the lookup lengths users get


def modes(draft_model: str, names: list[str], k: int, lookup_min: int) -> dict:
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": DEFAULTS.prompt_lookup_max,
             "prompt_lookup_min": lookup_min}
    every = {"off": None, "ngram": ngram,
             "draft_model": {"method": "draft_model", "model": draft_model, "num_speculative_tokens": k}}
    return {name: every[name] for name in names}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def run(llms: dict[str, LLM], workload, concurrency: int, ignore_eos: bool) -> tuple[dict, dict]:
    """The workload through a fresh engine per mode on its LLM's compiled runner, `concurrency` at a
    time: 1 is each request alone, one after the other, and then every mode serves a request before
    the next one comes, so a slow spell of this shared host falls on all modes alike. Returns each
    mode's figures and outputs (token ids in workload order)."""
    engines = {}
    for mode, llm in llms.items():
        config = dataclasses.replace(llm.config, scheduler=dataclasses.replace(llm.config.scheduler,
                                                                               max_num_seqs=concurrency))
        engines[mode] = LLMEngine(config, llm.engine.model_config, llm.runner, llm.tokenizer, llm.engine.max_model_len)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=ignore_eos) for r in workload]
    outputs = {mode: {} for mode in llms}
    wall, decode_s = dict.fromkeys(llms, 0.0), dict.fromkeys(llms, 0.0)
    batches = [list(range(len(workload)))] if concurrency > 1 else [[i] for i in range(len(workload))]
    for batch in batches:
        for mode, engine in engines.items():
            first_token_at = {}
            start = time.perf_counter()
            ids = {engine.add_request(workload[i].prompt_token_ids, params[i]): i for i in batch}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    now = time.perf_counter()
                    first_token_at.setdefault(out.request_id, now)
                    if out.finished:
                        outputs[mode][ids[out.request_id]] = out.outputs[0].token_ids
                        decode_s[mode] += now - first_token_at[out.request_id]
            wall[mode] += time.perf_counter() - start
    figures = {}
    for mode, engine in engines.items():
        # Decoding: each request's tokens after its first, over the time from its first token to its
        # last (1 / TPOT; the prefill before the first token costs the same with speculation or without).
        decode_tokens = sum(len(tokens) - 1 for tokens in outputs[mode].values())
        result = {"generated_tokens": engine.num_generated_tokens, "wall_s": wall[mode], "steps": engine.num_steps,
                  "tokens_per_s": engine.num_generated_tokens / wall[mode],
                  "decode_tokens_per_s": decode_tokens / decode_s[mode] if decode_s[mode] else 0.0}
        if engine.drafts is not None:
            s = engine.drafts.stats
            result |= {"draft_tokens": s.num_draft_tokens, "accepted_tokens": s.num_accepted_tokens,
                       "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length,
                       "accepted_per_position": s.accepted_per_position}
        figures[mode] = result
    return figures, {mode: [got[i] for i in range(len(workload))] for mode, got in outputs.items()}


def step_ms(llm: LLM, num_seqs: int, drafts_per_seq: int, context: int = 200, repeat: int = 10) -> float:
    """One decode step of `num_seqs` sequences with `context` cached tokens, each verifying
    `drafts_per_seq` drafts (1 + drafts rows): what the extra rows cost."""
    runner = llm.runner
    n = 1 + drafts_per_seq
    lookahead = runner.kv_layout.num_speculative_tokens  # slots a draft model writes ahead
    pages = -(-(context + n + lookahead) // runner.page_size)
    num_tokens, _ = runner.buckets.pick(num_seqs * n, num_seqs)
    plan = padding_plan(num_tokens, runner.buckets.pick_rows(num_seqs * n), runner.kv_layout, runner.config.vocab_size)
    for seq in range(num_seqs):
        table = np.arange(seq * pages, (seq + 1) * pages)
        plan.block_tables[seq, :pages] = table
        if plan.speculation is not None:  # the sequence samples and proposes, as a decoding request does
            spec = plan.speculation
            spec.row_first[seq * n:(seq + 1) * n], spec.row_seq[seq * n:(seq + 1) * n] = seq * n, seq
            spec.seq_first_row[seq], spec.seq_history_len[seq] = seq * n, context + 1
            spec.seq_proposes[seq], spec.seq_num_slots[seq] = True, pages * runner.page_size
            spec.any_proposes = np.bool_(True)
        tokens = slice(seq * n, (seq + 1) * n)
        positions = np.arange(context, context + n)
        plan.positions[tokens] = positions
        plan.segment_ids[tokens] = seq
        plan.slot_mapping[tokens] = table[positions // runner.page_size] * runner.page_size + positions % runner.page_size
        plan.kv_lens[seq] = context + n
        plan.logits_index[seq * n:(seq + 1) * n] = np.arange(seq * n, (seq + 1) * n)
    plan.num_real_tokens, plan.sampling.num_real_rows = num_seqs * n, np.int32(num_seqs * n)
    jax.device_get(runner.run_plan(plan))
    start = time.perf_counter()
    for _ in range(repeat):
        jax.device_get(runner.run_plan(plan))
    return 1000 * (time.perf_counter() - start) / repeat


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, steps) = plt.subplots(1, 2, figsize=(11, 4))
    cases = list(results["cases"])
    names = results["modes"]
    width = 0.8 / len(names)
    for i, mode in enumerate(names):
        values = [results["cases"][c][mode]["tokens_per_s"] for c in cases]
        bars.bar(np.arange(len(cases)) + (i - (len(names) - 1) / 2) * width, values, width, label=f"speculation {mode}")
    bars.set_xticks(np.arange(len(cases)), [c.replace(", ", "\n") for c in cases], fontsize=8)
    bars.set_ylabel("generated tokens/s")
    bars.set_title("SmolLM2-135M f32, greedy")
    bars.legend()
    titles = []
    for mode, cost in results["step_cost_ms"].items():
        steps.plot(range(len(cost["one_sequence"])), cost["one_sequence"], "o-", label=f"{mode}, 1 sequence")
        without, with_drafts = cost["sixteen_sequences"]
        titles.append(f"{mode}, 16 sequences: {without:.0f} / {with_drafts:.0f} ms")
    steps.set_xlabel("draft tokens verified per sequence (rows - 1)")
    steps.set_ylabel("step ms")
    steps.set_title("\n".join(titles) + f" (0 / {len(cost['one_sequence']) - 1} drafts each)", fontsize=8)
    steps.legend()
    fig.suptitle(results["cpu"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=9, help="copy-heavy requests (three kinds, in turn)")
    parser.add_argument("--throughput-requests", type=int, default=32, help="requests of the throughput workload")
    parser.add_argument("--out", type=Path, default=RESULTS / "spec_new.json",
                        help="default: a new file beside the committed spec_ngram.json")
    parser.add_argument("--draft-model", default=None, help="draft_model's model (default: the target itself)")
    parser.add_argument("--modes", default="off,ngram,draft_model", help="comma-separated; off always runs")
    parser.add_argument("--num-speculative-tokens", type=int, default=DEFAULTS.num_speculative_tokens,
                        help="k, for ngram and draft_model")
    parser.add_argument("--prompt-lookup-min", type=int, default=DEFAULTS.prompt_lookup_min,
                        help="ngram's shortest n-gram that counts as a match")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--matmul-impl", choices=MATMUL_IMPL_CHOICES, default="auto",
                        help="the float matrices' matmuls, for every engine (docs/quantization.md, matmul_impl)")
    args = parser.parse_args()
    names = ["off"] + [m for m in args.modes.split(",") if m and m != "off"]
    specs = modes(args.draft_model or args.model, names, args.num_speculative_tokens, args.prompt_lookup_min)

    llms = {mode: LLM(args.model, max_num_seqs=16, max_num_batched_tokens=512, speculative_config=spec,
                      max_model_len=2048, matmul_impl=args.matmul_impl, show_progress=False)
            for mode, spec in specs.items()}
    for llm in llms.values():  # every program's slow first run, before the timing (a server's idle thread does it)
        llm.runner.run_first_runs()
    tokenizer = llms["off"].tokenizer
    copy_heavy = copy_heavy_workload(tokenizer, args.num_requests)
    throughput = mixed_workload(tokenizer, args.throughput_requests)
    every_case = {"copy1": ("copy-heavy, 1 stream", (copy_heavy, 1, False)),
                  "copy16": ("copy-heavy, 16 at once", (copy_heavy, 16, False)),
                  "throughput16": ("throughput, 16 at once", (throughput, 16, True))}
    cases = dict(every_case[name] for name in args.cases.split(","))
    results = {"machine": machine.describe(), "cpu": cpu_name(), "jax": jax.__version__, "model": args.model, "dtype": "float32", "modes": names,
               "matmul_impl": llms["off"].runner.matmul_impl,
               "speculative_config": {m: spec for m, spec in specs.items() if spec}, "cases": {}}
    for case, (workload, concurrency, ignore_eos) in cases.items():
        figures, outputs = run(llms, workload, concurrency, ignore_eos)
        off = figures["off"]
        line = f"{case:24s} off {off['tokens_per_s']:6.1f} tok/s (decoding {off['decode_tokens_per_s']:.1f})"
        for mode in names[1:]:
            figures[f"{mode}_over_off"] = figures[mode]["tokens_per_s"] / off["tokens_per_s"]
            figures[f"{mode}_decode_over_off"] = figures[mode]["decode_tokens_per_s"] / off["decode_tokens_per_s"]
            figures[f"{mode}_identical_outputs"] = outputs[mode] == outputs["off"]
            f = figures[mode]
            line += (f" | {mode} {f['tokens_per_s']:6.1f} tok/s ({figures[f'{mode}_over_off']:.2f}x; decoding "
                     f"{f['decode_tokens_per_s']:.1f}, {figures[f'{mode}_decode_over_off']:.2f}x), acceptance "
                     f"{f['acceptance_rate']:.2f}, {f['mean_acceptance_length']:.2f} tokens/verifying step, identical: "
                     f"{figures[f'{mode}_identical_outputs']}")
        results["cases"][case] = figures
        print(line, flush=True)
    results["step_cost_ms"] = {}
    k = args.num_speculative_tokens
    for mode in names[1:]:
        cost = results["step_cost_ms"][mode] = {"one_sequence": [step_ms(llms[mode], 1, j) for j in range(k + 1)],
                                                "sixteen_sequences": [step_ms(llms[mode], 16, 0),
                                                                      step_ms(llms[mode], 16, k)]}
        print(f"{mode} step ms, 1 sequence with 0..{k} drafts: "
              + ", ".join(f"{ms:.1f}" for ms in cost["one_sequence"])
              + f"; 16 sequences with 0 / {k} drafts: {cost['sixteen_sequences'][0]:.1f} / "
              f"{cost['sixteen_sequences'][1]:.1f}")
    print(f"compilations after warm-up: {[llm.num_compilations_after_warmup for llm in llms.values()]}")
    results["compilations_after_warmup"] = {mode: llm.num_compilations_after_warmup for mode, llm in llms.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(f"saved {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
