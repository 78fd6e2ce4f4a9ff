"""Benchmark workloads: seeded and reproducible, the promised distributions, JSONL round trip."""

import itertools
import statistics

import pytest
from workloads import (
    WorkloadRequest,
    WorkloadSpec,
    build_workload,
    load_jsonl,
    mixed_workload,
    named_spec,
    sample_arrivals,
    sample_lengths,
    save_jsonl,
)


class ByteTokenizer:
    """A stand-in for a model tokenizer: one token per UTF-8 byte, so decode(encode(x)) == x."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def test_same_seed_same_workload_other_seed_other_workload():
    spec = WorkloadSpec(num_requests=20, output_dist="zipf", arrival="poisson", seed=3)
    a, b = build_workload(ByteTokenizer(), spec), build_workload(ByteTokenizer(), spec)
    assert a == b
    other = build_workload(ByteTokenizer(), WorkloadSpec(num_requests=20, output_dist="zipf", arrival="poisson", seed=4))
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in other]


def test_prompts_have_the_sampled_lengths_and_their_text():
    spec = WorkloadSpec(num_requests=30, prompt_len=(5, 50), output_len=(1, 9), seed=1)
    requests = build_workload(ByteTokenizer(), spec)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in requests] == sample_lengths(spec)
    assert requests[0].prompt == ByteTokenizer().decode(requests[0].prompt_token_ids)


def test_length_distributions():
    n = 4000
    zipf = [o for _, o in sample_lengths(WorkloadSpec(num_requests=n, output_dist="zipf", output_len=(8, 128)))]
    uniform = [o for _, o in sample_lengths(WorkloadSpec(num_requests=n, output_dist="uniform", output_len=(8, 128)))]
    equal = sample_lengths(WorkloadSpec(num_requests=50, prompt_dist="equal", prompt_len=(10, 70),
                                        output_dist="equal", output_len=(3, 33)))
    assert min(zipf) >= 8 and max(zipf) <= 128 and min(uniform) >= 8 and max(uniform) <= 128
    # Heavy tail: most requests short, the mean pulled up by a few long ones, the top reached.
    assert statistics.median(zipf) < 0.7 * statistics.mean(zipf)
    assert max(zipf) > 100
    assert abs(statistics.median(uniform) - 68) < 5
    assert set(equal) == {(70, 33)}


@pytest.mark.parametrize("arrival, cv", [("poisson", 1.0), ("gamma", 3.0)])
def test_arrival_processes_have_the_asked_rate_and_burstiness(arrival, cv):
    arrivals = sample_arrivals(WorkloadSpec(num_requests=5000, arrival=arrival, rate=4.0, cv=cv))
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert arrivals[0] == 0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.15)
    assert sample_arrivals(WorkloadSpec(num_requests=5, arrival="all")) == [0.0] * 5


def test_arrivals_do_not_change_the_requests():
    lengths = sample_lengths(WorkloadSpec(num_requests=10, arrival="all"))
    assert sample_lengths(WorkloadSpec(num_requests=10, arrival="gamma")) == lengths


def test_jsonl_round_trip(tmp_path):
    requests = build_workload(ByteTokenizer(), WorkloadSpec(num_requests=7, arrival="gamma", seed=2))
    save_jsonl(requests, tmp_path / "w.jsonl")
    assert load_jsonl(tmp_path / "w.jsonl") == requests
    (tmp_path / "ids.jsonl").write_text('{"prompt_token_ids": [1, 2], "max_tokens": 4}\n')
    assert load_jsonl(tmp_path / "ids.jsonl") == [WorkloadRequest([1, 2], 4, 0.0, None)]
    (tmp_path / "bad.jsonl").write_text('{"max_tokens": 4}\n')
    with pytest.raises(ValueError, match="prompt_token_ids"):
        load_jsonl(tmp_path / "bad.jsonl")


def test_named_kinds_and_bad_specs():
    assert set(sample_lengths(named_spec("equal", 8))) == {(112, 64)}
    # `throughput` is bench_throughput.py's workload, so a server bench can replay the same requests:
    # 64 requests, 13136 prompt and 6670 output tokens (the figures compared with llama-server).
    lengths = sample_lengths(named_spec("throughput", 64))
    assert all(100 <= p <= 300 and 8 <= o <= 256 for p, o in lengths)
    assert (sum(p for p, _ in lengths), sum(o for _, o in lengths)) == (13136, 6670)
    tokenizer = ByteTokenizer()
    assert mixed_workload(tokenizer, 4) == build_workload(tokenizer, named_spec("throughput", 4))
    with pytest.raises(ValueError, match="choose one of"):
        named_spec("bursty", 8)
    with pytest.raises(ValueError, match="lo <= hi"):
        WorkloadSpec(output_len=(10, 5))
    with pytest.raises(ValueError, match="arrival"):
        WorkloadSpec(arrival="sometimes")


def test_shared_prefix_starts_every_prompt():
    spec = WorkloadSpec(num_requests=6, prompt_len=(20, 40), shared_prefix=16, seed=5)
    requests = build_workload(ByteTokenizer(), spec)
    assert [len(r.prompt_token_ids) for r in requests] == [p for p, _ in sample_lengths(spec)]
    assert len({tuple(r.prompt_token_ids[:16]) for r in requests}) == 1
    assert len({tuple(r.prompt_token_ids[16:20]) for r in requests}) > 1
    with pytest.raises(ValueError, match="shared_prefix"):
        WorkloadSpec(prompt_len=(16, 40), shared_prefix=16)
