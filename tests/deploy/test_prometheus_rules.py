"""deploy/prometheus/alerts.yml: valid rules, and every alert fires on its bad series and stays quiet on
the good ones (alerts_test.yml, run by `promtool test rules`)."""

from __future__ import annotations

import subprocess

import yaml

from .conftest import DEPLOY, require_promtool

RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"


def test_rules_are_valid():
    result = subprocess.run([require_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_fires_and_stays_quiet():
    result = subprocess.run([require_promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_unit_tested_and_has_a_runbook():
    """promtool passes a test file that forgets an alert; this does not."""
    alerts = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
              if "alert" in rule]
    tested = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in test.get("alert_rule_test", []) if case["exp_alerts"]}
    assert {alert["alert"] for alert in alerts} - tested == set(), "alerts with no firing test case"
    for alert in alerts:
        assert alert["annotations"].get("runbook"), f"{alert['alert']} has no runbook line"
    names = {alert["alert"] for alert in alerts}
    # The alerts the issue asks for (KV > 90% for 3 min is checked exactly by alerts_test.yml).
    assert {"OrcaJaxKVCacheAlmostFull", "OrcaJaxQueueGrowing", "OrcaJaxE2ELatencyHigh", "OrcaJaxTimeToFirstTokenHigh",
            "OrcaJaxPreempting", "OrcaJaxCompilationAfterWarmup", "OrcaJaxEngineNotReady"} <= names


def test_rules_name_only_series_the_server_exposes():
    """A renamed metric would leave an alert that can never fire; promtool cannot see that."""
    import re

    from .test_grafana import exposed_series

    known = exposed_series() | {"up"}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            for name in re.findall(r"orca_jax[\w:]*", rule["expr"]):
                assert name in known, f"{rule.get('alert') or rule['record']}: {name} is neither exposed nor recorded"


def test_engine_ready_and_max_num_seqs_series():
    from orca_jax.engine.async_engine import EngineStats
    from orca_jax.server.metrics import ServerMetrics

    stats = None
    metrics = ServerMetrics(lambda: stats)
    assert metrics.registry.get_sample_value("orca_jax_engine_ready") == 0  # warming up
    stats = EngineStats()
    metrics.set_engine_limits(max_num_seqs=32)
    assert metrics.registry.get_sample_value("orca_jax_engine_ready") == 1
    assert metrics.registry.get_sample_value("orca_jax_max_num_seqs") == 32
