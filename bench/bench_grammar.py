"""Grammar engines for structured outputs: llguidance against xgrammar on SmolLM2's tokenizer (49152 tokens).

    orca-jax bench grammar                          # llguidance only (the engine's dependency)
    PYTHONPATH=/path/with/xgrammar python bench/bench_grammar.py   # both, where xgrammar imports

For each JSON schema it measures, per engine: the schema's compile time (grammar plus token tables,
what a request pays before its first token) and the host time to compute one token bitmask
[ceil(V/32)] int32 along a valid output (what every decode step of a constrained request pays),
walking the tokens of a fixed valid instance. Prints a table and saves
bench/results/grammar_new.json (or --out; the committed figures are grammar.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `orca-jax bench` runs it by path
import machine  # noqa: E402

from orca_jax.config import DEFAULT_MODEL, REPO_ROOT
from orca_jax.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"

SCHEMAS = {  # name: (schema, a valid instance the walk feeds token by token)
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}, {"name": "Ada Lovelace", "age": 36}),
    "enum+array": ({"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4}},
        "required": ["color", "tags"]}, {"color": "green", "tags": ["a", "bc", "def"]}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                              "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"]}},
            "required": ["id", "address"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
        "required": ["user", "scores"]},
        {"user": {"id": 7, "address": {"city": "Paris", "zip": "75001"}}, "scores": [1.5, 2.25]}),
}


def json_text(value) -> str:
    return json.dumps(value, separators=(", ", ": "))


def bench_llguidance(tokenizer: Tokenizer, schema: dict, instance) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.numpy

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=tokenizer.vocab_size,
                                   eos_token=tokenizer.eos_token_id)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    compile_s = time.perf_counter() - start
    bitmask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
    mask_s = []
    for token in tokenizer.encode(json_text(instance)):
        start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        mask_s.append(time.perf_counter() - start)
        assert matcher.consume_token(token), matcher.get_error()
    return tokenizer_s, compile_s, mask_s


def bench_xgrammar(tokenizer: Tokenizer, schema: dict, instance) -> tuple[float, list[float]]:
    import torch
    import transformers
    import xgrammar

    start = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf, eos_token="<|im_end|>")
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
    matcher = xgrammar.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)
    assert bitmask.dtype == torch.int32
    mask_s = []
    for token in tokenizer.encode(json_text(instance)):
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        mask_s.append(time.perf_counter() - start)
        assert matcher.accept_token(token)
    return tokenizer_s, compile_s, mask_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "grammar_new.json")
    args = parser.parse_args()
    tokenizer = Tokenizer.load(REPO_ROOT / "checkpoints" / DEFAULT_MODEL)
    engines = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}
    rows = []
    for engine, run in engines.items():
        try:
            run(tokenizer, *SCHEMAS["flat"])  # imports and first-use costs outside the figures
        except ImportError as error:
            print(f"{engine}: not importable here ({error}); skipped")
            continue
        for name, (schema, instance) in SCHEMAS.items():
            tokenizer_s, compile_s, mask_s = run(tokenizer, schema, instance)
            row = dict(engine=engine, schema=name, tokenizer_setup_ms=1e3 * tokenizer_s, compile_ms=1e3 * compile_s,
                       tokens=len(mask_s), mask_median_us=1e6 * statistics.median(mask_s),
                       mask_p90_us=1e6 * float(np.percentile(mask_s, 90)), mask_max_us=1e6 * max(mask_s))
            rows.append(row)
            print(f"{engine:10s} {name:11s} tokenizer {row['tokenizer_setup_ms']:7.1f} ms  compile "
                  f"{row['compile_ms']:7.2f} ms  mask median {row['mask_median_us']:6.1f} us  p90 "
                  f"{row['mask_p90_us']:6.1f} us  max {row['mask_max_us']:7.1f} us  ({row['tokens']} tokens)")
    args.out.write_text(json.dumps({"machine": machine.describe(), "rows": rows}, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
