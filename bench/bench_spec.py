"""Speculative decoding: speculation off vs n-gram drafts, one stream and 16 at once, on a copy-heavy
workload (answers that repeat their prompt) and on the `throughput` workload.

    python bench/bench_spec.py [--num-requests 9] [--throughput-requests 32] [--out bench/results/spec_new.json]

Both engines run the same greedy requests (outputs must be identical, token for token; the JSON
records whether they were); the figures are generated tok/s, the ratio ngram / off (within this
run), the acceptance (drafts accepted / verified, mean tokens per verifying step), and the step-time
cost of the extra rows (one decode with 0..k drafts, and 16 decodes with 0 or k drafts each, timed
on the runner). Prints one line per case, saves the JSON and a plot beside it. The draft-model
method is not implemented yet, so it has no column.
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
from workloads import copy_heavy_workload, mixed_workload  # noqa: E402

from orca_jax import LLM, SamplingParams  # noqa: E402
from orca_jax.config import SchedulerConfig  # noqa: E402
from orca_jax.engine.engine import LLMEngine  # noqa: E402
from orca_jax.engine.step_plan import padding_plan  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"off": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                "prompt_lookup_min": 2}}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def run(llm: LLM, workload, concurrency: int, ignore_eos: bool) -> dict:
    """The workload through a fresh engine on the LLM's compiled runner, `concurrency` at a time
    (1: each request alone, one after the other)."""
    config = dataclasses.replace(llm.config, scheduler=dataclasses.replace(llm.config.scheduler, max_num_seqs=concurrency))
    engine = LLMEngine(config, llm.engine.model_config, llm.runner, llm.tokenizer, llm.engine.max_model_len)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=ignore_eos) for r in workload]
    outputs = {}
    start = time.perf_counter()
    batches = [list(range(len(workload)))] if concurrency > 1 else [[i] for i in range(len(workload))]
    for batch in batches:
        ids = {engine.add_request(workload[i].prompt_token_ids, params[i]): i for i in batch}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[ids[out.request_id]] = out.outputs[0].token_ids
    wall = time.perf_counter() - start
    result = {"generated_tokens": engine.num_generated_tokens, "wall_s": wall, "steps": engine.num_steps,
              "tokens_per_s": engine.num_generated_tokens / wall}
    if engine.drafts is not None:
        s = engine.drafts.stats
        result |= {"draft_tokens": s.num_draft_tokens, "accepted_tokens": s.num_accepted_tokens,
                   "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length,
                   "accepted_per_position": s.accepted_per_position}
    return result, [outputs[i] for i in range(len(workload))]


def step_ms(llm: LLM, num_seqs: int, drafts_per_seq: int, context: int = 200, repeat: int = 10) -> float:
    """One decode step of `num_seqs` sequences with `context` cached tokens, each verifying
    `drafts_per_seq` drafts (1 + drafts rows): what the extra rows cost."""
    runner = llm.runner
    n = 1 + drafts_per_seq
    pages = -(-(context + n) // runner.page_size)
    num_tokens, _ = runner.buckets.pick(num_seqs * n, num_seqs)
    plan = padding_plan(num_tokens, runner.buckets.pick_rows(num_seqs * n), runner.kv_layout, runner.config.vocab_size)
    for seq in range(num_seqs):
        table = np.arange(seq * pages, (seq + 1) * pages)
        plan.block_tables[seq, :pages] = table
        tokens = slice(seq * n, (seq + 1) * n)
        positions = np.arange(context, context + n)
        plan.positions[tokens] = positions
        plan.segment_ids[tokens] = seq
        plan.slot_mapping[tokens] = table[positions // runner.page_size] * runner.page_size + positions % runner.page_size
        plan.kv_lens[seq] = context + n
        plan.logits_index[seq * n:(seq + 1) * n] = np.arange(seq * n, (seq + 1) * n)
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
    width = 0.38
    for i, mode in enumerate(MODES):
        values = [results["cases"][c][mode]["tokens_per_s"] for c in cases]
        bars.bar(np.arange(len(cases)) + (i - 0.5) * width, values, width, label=f"speculation {mode}")
    bars.set_xticks(np.arange(len(cases)), [c.replace(", ", "\n") for c in cases], fontsize=8)
    bars.set_ylabel("generated tokens/s")
    bars.set_title("SmolLM2-135M f32, greedy")
    bars.legend()
    cost = results["step_cost_ms"]
    steps.plot(range(len(cost["one_sequence"])), cost["one_sequence"], "o-", label="1 sequence")
    steps.set_xlabel("draft tokens verified per sequence (rows - 1)")
    steps.set_ylabel("step ms")
    steps.set_title(f"16 sequences: {cost['sixteen_sequences'][0]:.0f} ms without drafts, "
                    f"{cost['sixteen_sequences'][1]:.0f} ms with 4 each", fontsize=9)
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
                        help="default: a new file beside the committed spec.json")
    args = parser.parse_args()

    llms = {mode: LLM(args.model, max_num_seqs=16, max_num_batched_tokens=512, speculative_config=spec,
                      max_model_len=2048, show_progress=False) for mode, spec in MODES.items()}
    tokenizer = llms["off"].tokenizer
    copy_heavy = copy_heavy_workload(tokenizer, args.num_requests)
    throughput = mixed_workload(tokenizer, args.throughput_requests)
    cases = {"copy-heavy, 1 stream": (copy_heavy, 1, False), "copy-heavy, 16 at once": (copy_heavy, 16, False),
             "throughput, 16 at once": (throughput, 16, True)}
    results = {"cpu": cpu_name(), "jax": jax.__version__, "model": args.model, "dtype": "float32",
               "speculative_config": MODES["ngram"], "cases": {}}
    for case, (workload, concurrency, ignore_eos) in cases.items():
        figures, outputs = {}, {}
        for mode, llm in llms.items():
            figures[mode], outputs[mode] = run(llm, workload, concurrency, ignore_eos)
        figures["ngram_over_off"] = figures["ngram"]["tokens_per_s"] / figures["off"]["tokens_per_s"]
        figures["identical_outputs"] = outputs["ngram"] == outputs["off"]
        results["cases"][case] = figures
        ngram = figures["ngram"]
        print(f"{case:24s} off {figures['off']['tokens_per_s']:6.1f} tok/s  ngram {ngram['tokens_per_s']:6.1f} tok/s "
              f"({figures['ngram_over_off']:.2f}x)  acceptance {ngram['acceptance_rate']:.2f}, "
              f"{ngram['mean_acceptance_length']:.2f} tokens per verifying step, identical: "
              f"{figures['identical_outputs']}")
    spec = llms["ngram"]
    results["step_cost_ms"] = {"one_sequence": [step_ms(spec, 1, j) for j in range(5)],
                               "sixteen_sequences": [step_ms(spec, 16, 0), step_ms(spec, 16, 4)]}
    cost = results["step_cost_ms"]
    print("step ms, 1 sequence with 0..4 drafts: " + ", ".join(f"{ms:.1f}" for ms in cost["one_sequence"])
          + f"; 16 sequences with 0 / 4 drafts: {cost['sixteen_sequences'][0]:.1f} / {cost['sixteen_sequences'][1]:.1f}")
    print(f"compilations after warm-up: {[llm.num_compilations_after_warmup for llm in llms.values()]}")
    results["compilations_after_warmup"] = {mode: llm.num_compilations_after_warmup for mode, llm in llms.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(f"saved {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
