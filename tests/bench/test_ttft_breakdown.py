"""bench/ttft_breakdown.py's pure parts on hand-made traces: reading a trace, matching the engine's
requests to the load generator's, the per-request split of the TTFT, the per-step times and prices,
and the summary. (The traced server that writes such traces: test_trace_server.py.)"""

import json

import pytest
from orca_jax.tuning.loadgen import Measured
from ttft_breakdown import match_requests, read_trace, request_rows, step_rows, summarize


def ok(scheduled, sent, first):
    return Measured(True, first - scheduled, 0.05, 4, scheduled_at=scheduled, sent_at=sent, first_at=first)


def sim_row(wait, ttft):
    """What report.per_request gives each request (the columns request_rows reads)."""
    return {"sim_wait_s": wait, "sim_ttft_s": ttft}


def test_read_trace_keeps_each_event_kind_in_the_order_written(tmp_path):
    records = [{"event": "dispatch", "t": 1.0, "chunks": []}, {"event": "add", "request": "a", "t": 0.5},
               {"event": "collect", "t0": 1.1, "t": 1.2}, {"event": "dispatch", "t": 2.0, "chunks": []},
               {"event": "first", "request": "a", "t": 1.2}]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    adds, dispatches, collects, firsts = read_trace(path)
    assert [d["t"] for d in dispatches] == [1.0, 2.0]
    assert adds == [records[1]] and collects == [records[2]] and firsts == [records[4]]


def test_requests_are_matched_by_lengths_then_by_the_closest_post():
    # Request 0 never reached the engine. y's arrival is closest to request 2's POST, but its lengths
    # are those of 0 and 1, and of those 1's POST is the closer.
    measured = [ok(10.0, 10.0, 11.0), ok(10.2, 10.2, 11.0), ok(10.4, 10.4, 11.0)]
    lengths = [(8, 4), (8, 4), (16, 4)]
    adds = [{"request": "x", "arrival": 10.42, "prompt_len": 16, "max_tokens": 4},
            {"request": "y", "arrival": 10.41, "prompt_len": 8, "max_tokens": 4}]
    assert match_requests(adds, measured, lengths) == {"y": 1, "x": 2}


def test_the_ttft_is_split_at_the_trace_events():
    measured = [ok(10.0, 10.01, 11.0)]
    adds = [{"request": "a", "t": 10.03, "arrival": 10.02, "prompt_len": 8, "max_tokens": 4}]
    dispatches = [{"t": 10.1, "chunks": [["a", 0, 8, True]]}, {"t": 10.5, "chunks": [["a", 8, 1, True]]}]
    firsts = [{"request": "a", "t": 10.9}]
    rows, failed = request_rows({"a": 0}, adds, dispatches, firsts, measured, [sim_row(0.1, 0.4)])
    assert failed == []
    (row,) = rows
    assert row["index"] == 0
    # intake: POST -> taken; wait: taken -> first dispatch (not the later one); prefill: -> first
    # token; delivery: -> the client read it.
    assert row["intake_s"] == pytest.approx(0.02) and row["wait_s"] == pytest.approx(0.07)
    assert row["prefill_s"] == pytest.approx(0.8) and row["delivery_s"] == pytest.approx(0.1)
    assert row["sim_prefill_s"] == pytest.approx(0.3)


def test_a_request_that_failed_is_named_not_a_key_error():
    # Request 0 failed before its first token (the engine took it, never scheduled it); request 1,
    # of the same lengths, was served. The failed one's add must not take the served one's place.
    measured = [Measured(False, error="engine aborted", scheduled_at=10.0, sent_at=10.0),
                ok(10.5, 10.51, 11.0)]
    adds = [{"request": "r0", "t": 10.02, "arrival": 10.01, "prompt_len": 8, "max_tokens": 4},
            {"request": "r1", "t": 10.53, "arrival": 10.52, "prompt_len": 8, "max_tokens": 4}]
    dispatches = [{"t": 10.55, "chunks": [["r1", 0, 8, True]]}]
    firsts = [{"request": "r1", "t": 10.9}]
    index = match_requests(adds, measured, [(8, 4), (8, 4)])
    rows, failed = request_rows(index, adds, dispatches, firsts, measured, [sim_row(0.1, 0.4)] * 2)
    assert [r["index"] for r in rows] == [1]
    assert rows[0]["intake_s"] == pytest.approx(0.02) and rows[0]["delivery_s"] == pytest.approx(0.1)
    assert failed == [{"index": 0, "request": "r0", "error": "engine aborted"}]


def test_requests_without_a_trace_of_their_own_are_named_too():
    # One refused before the engine took it (no add), one served whose add the trace lacks.
    measured = [Measured(False, error="400: too long", scheduled_at=10.0, sent_at=10.0), ok(10.5, 10.5, 11.0)]
    rows, failed = request_rows({}, [], [], [], measured, [sim_row(0.1, 0.4)] * 2)
    assert rows == []
    assert failed == [{"index": 0, "request": None, "error": "400: too long"},
                      {"index": 1, "request": None, "error": "served, but no add event in the trace matched it"}]


def test_steps_start_at_the_first_add_and_are_timed_from_the_previous_collection():
    adds = [{"t": 5.0}]
    dispatches = [{"t": 4.0, "chunks": [["warm", 0, 16, True]]},  # the warm-up: before any request
                  {"t": 5.1, "chunks": [["a", 0, 8, True], ["b", 3, 1, True]]},
                  {"t": 5.2, "chunks": [["a", 8, 1, True], ["b", 4, 1, True]]},  # planned while 5.1 ran
                  {"t": 7.0, "chunks": [["a", 9, 1, True]]}]  # planned after an idle spell
    collects = [{"t0": 4.0, "t": 4.5}, {"t0": 5.2, "t": 5.6}, {"t0": 5.6, "t": 6.0}, {"t0": 7.0, "t": 7.3}]
    steps = step_rows(adds, dispatches, collects, start=5.0, price=lambda step: 0.01 * sum(n for _, n in step.chunks))
    assert len(steps) == 3
    first, second, third = steps
    assert first["dispatched"] == pytest.approx(0.1) and first["collected"] == pytest.approx(0.6)
    assert first["waited"] == pytest.approx(0.4) and "measured_s" not in first
    assert (first["prefill_tokens"], first["decodes"]) == (8, 1)
    assert first["predicted_s"] == pytest.approx(0.09)
    assert second["measured_s"] == pytest.approx(0.4)  # from the previous collection (5.6 -> 6.0)
    assert third["measured_s"] == pytest.approx(0.3)  # from its own dispatch (7.0 -> 7.3), not 6.0
    assert (third["prefill_tokens"], third["decodes"]) == (0, 1)


def breakdown_out(failed):
    row = {"ttft_s": 0.9, "send_lag_s": 0.01, "intake_s": 0.02, "wait_s": 0.3, "prefill_s": 0.5, "delivery_s": 0.07,
           "sim_wait_s": 0.25, "sim_prefill_s": 0.45}
    steps = [{"prefill_tokens": 8, "predicted_s": 0.5}, {"prefill_tokens": 8, "measured_s": 0.4, "predicted_s": 0.5},
             {"prefill_tokens": 0, "measured_s": 0.2, "predicted_s": 0.1}]
    return {"settings": "fcfs", "rate_rps": 1.5, "ttft_p99_s": 0.9, "sim_ttft_p99_s": 0.8, "tpot_p99_s": 0.05,
            "sim_tpot_p99_s": 0.04, "steps": 3, "sim_steps": 4, "requests": [row] * 4, "step_trace": steps,
            "failed": failed}


def test_summary_means_and_step_prices():
    text = summarize(breakdown_out([]))
    assert text.splitlines()[0] == ("fcfs at 1.500 req/s: TTFT p99 measured 0.90 s, simulated 0.80; "
                                    "TPOT p99 0.050 / 0.040; steps 3 / 4")
    assert "all        (4): measured send_lag 0.010, intake 0.020, wait 0.300, prefill 0.500, delivery 0.070" in text
    assert "simulated wait 0.250, prefill 0.450" in text
    # Only steps with a measured time are set beside their price.
    assert "steps decode only: 1, measured 0.2 s, priced 0.1 s (-50%)" in text
    assert "steps with prefill: 1, measured 0.4 s, priced 0.5 s (+25%)" in text
    assert "failed" not in text


def test_summary_counts_and_names_the_failed_requests():
    text = summarize(breakdown_out([{"index": 3, "request": "r3", "error": "engine aborted"},
                                    {"index": 7, "request": None, "error": "400: too long"}]))
    assert "failed: 2 of 6 requests, left out of the figures above: #3 engine aborted; #7 400: too long" in text
