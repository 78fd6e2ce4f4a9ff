"""deploy/grafana/orca-jax.json: a dashboard whose every query names only series that exist: metrics
a server exposes (rendered here from the real ServerMetrics) or recording rules of alerts.yml."""

from __future__ import annotations

import json
import re

import yaml

from orca_jax.engine.async_engine import EngineStats
from orca_jax.engine.speculation import SpeculationStats
from orca_jax.outputs import RequestMetrics
from orca_jax.server.metrics import ServerMetrics

from .conftest import DEPLOY

DASHBOARD = DEPLOY / "grafana" / "orca-jax.json"


def exposed_series() -> set[str]:
    # With speculative decoding's counters, which a server exposes only when it speculates.
    metrics = ServerMetrics(lambda: EngineStats(speculation=SpeculationStats(accepted_per_position=[0, 0])))
    metrics.on_finished(RequestMetrics(arrival_time=0.0), "stop", 5)  # labelled series appear once used
    text = metrics.render().decode()
    series = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    return series | {rule["record"] for group in rules for rule in group["rules"] if "record" in rule}


def test_every_query_names_existing_series():
    dashboard = json.loads(DASHBOARD.read_text())
    known = exposed_series()
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert expressions
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            expressions.append(variable["query"])
    for expr in expressions:
        for name in re.findall(r"orca_jax[\w:]*", expr):
            assert name in known, f"{name} (in {expr!r}) is neither exposed nor recorded"


def test_the_panels_the_issue_asks_for():
    dashboard = json.loads(DASHBOARD.read_text())
    text = json.dumps([panel["targets"] for panel in dashboard["panels"]])
    for needed in ("orca_jax_generation_tokens_total", "orca_jax_time_to_first_token_seconds_bucket",
                   "orca_jax_inter_token_latency_seconds_bucket", "orca_jax_e2e_request_latency_seconds_bucket",
                   "orca_jax_num_requests_running", "orca_jax_num_requests_waiting", "orca_jax_kv_cache_usage",
                   "orca_jax_preemptions_total", "orca_jax_prefix_cache_hits_total"):
        assert needed in text, needed
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_speculative_decoding_panels():
    """Acceptance rate, tokens per verifying step and acceptance by position (vLLM's spec_decode
    figures), each from the counters it needs."""
    panels = {panel["title"]: json.dumps(panel["targets"]) for panel in json.loads(DASHBOARD.read_text())["panels"]}
    needs = {"Draft acceptance rate": ("num_accepted_tokens_total", "num_draft_tokens_total"),
             "Tokens per verifying step": ("num_accepted_tokens_total", "num_drafts_total"),
             "Drafts accepted by position": ("num_accepted_tokens_per_pos_total", "num_drafts_total")}
    for title, counters in needs.items():
        assert title in panels, title
        for counter in counters:
            assert f"orca_jax_spec_decode_{counter}" in panels[title], (title, counter)
