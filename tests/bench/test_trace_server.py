"""bench/trace_server.py's trace, written by a real engine (over the mock runner: no model, a
fraction of a second) and read back with ttft_breakdown.read_trace: one add per request with its
lengths and arrival, each step's chunks as dispatched, a collect per dispatch, one first token per
request."""

import dataclasses

import pytest
from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig, load_model_preset
from orca_jax.engine.engine import LLMEngine
from orca_jax.sampling_params import SamplingParams
from trace_server import install
from ttft_breakdown import read_trace

from tests.engine.mock_runner import MockRunner

VOCAB = 1000
MODEL = dataclasses.replace(load_model_preset("tiny"), vocab_size=VOCAB, eos_token_id=None, max_position=4096)


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """install() rewraps LLMEngine's methods for good (the traced server's process): kept here only
    for this test."""
    for name in ("add_request", "_dispatch", "_collect_oldest", "_update"):
        monkeypatch.setattr(LLMEngine, name, getattr(LLMEngine, name))
    trace = tmp_path / "trace.jsonl"
    install(str(trace))
    return trace


def test_the_trace_holds_each_request_and_step(traced):
    budget = 16  # tokens per step: the 20-token prompt is prefilled in two chunks
    config = EngineConfig(model="mock", cache=CacheConfig(page_size=4),
                          scheduler=SchedulerConfig(policy="chunked", max_num_seqs=4, max_num_batched_tokens=budget,
                                                    async_scheduling=True))
    runner = MockRunner(64, 4, VOCAB, max_num_seqs=4, max_num_batched_tokens=budget, feeds_sampled_tokens=True)
    engine = LLMEngine(config, MODEL, runner, tokenizer=None)
    long = engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=3, temperature=0), arrival_time=5.0)
    short = engine.add_request([7, 8, 9], SamplingParams(max_tokens=2, temperature=0), arrival_time=6.0)
    while engine.has_unfinished_requests():
        engine.step()

    adds, dispatches, collects, firsts = read_trace(traced)
    assert [(a["request"], a["arrival"], a["prompt_len"], a["max_tokens"]) for a in adds] == [
        (long, 5.0, 20, 3), (short, 6.0, 3, 2)]
    chunks = {rid: [(start, n, samples) for d in dispatches for r, start, n, samples in d["chunks"] if r == rid]
              for rid in (long, short)}
    # Prompt chunks, then one decode per further token; only a prompt's last chunk samples.
    assert chunks[long] == [(0, 16, False), (16, 4, True), (20, 1, True), (21, 1, True)]
    assert chunks[short] == [(0, 3, True), (3, 1, True)]
    assert all(sum(n for _, _, n, _ in d["chunks"]) <= budget for d in dispatches)

    assert len(collects) == len(dispatches)  # the n-th collect is the n-th dispatch's
    for d, c in zip(dispatches, collects):
        assert d["t"] <= c["t0"] <= c["t"]
    assert [f["request"] for f in firsts].count(long) == 1 and [f["request"] for f in firsts].count(short) == 1
    # A first token is recorded after the step that sampled it was collected.
    sampled_at = next(i for i, d in enumerate(dispatches) if [long, 16, 4, True] in d["chunks"])
    first_long = next(f["t"] for f in firsts if f["request"] == long)
    assert first_long >= collects[sampled_at]["t"]
    assert all(adds[0]["t"] <= d["t"] for d in dispatches)
