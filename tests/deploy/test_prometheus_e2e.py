"""End to end with a real Prometheus: it scrapes a real server on loopback, with the real
deploy/prometheus/alerts.yml loaded, while clients fill the server's KV cache; through Prometheus's
HTTP API the series must exist with the scrape's labels, the recording rules must compute, and the
KV-cache alert must go pending (its `for: 3m` keeps it from firing within the test; pending needs
only the expression to be true). Every wait is bounded; everything binds to 127.0.0.1.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest

from ..server.conftest import http
from .conftest import DEPLOY, require_prometheus

RULES = DEPLOY / "prometheus" / "alerts.yml"
SERIES = ("orca_jax_num_requests_running", "orca_jax_num_requests_waiting", "orca_jax_kv_cache_usage",
          "orca_jax_preemptions_total", "orca_jax_generation_tokens_total", "orca_jax_prompt_tokens_total",
          "orca_jax_requests_total", "orca_jax_time_to_first_token_seconds_bucket",
          "orca_jax_e2e_request_latency_seconds_bucket", "orca_jax_inter_token_latency_seconds_bucket",
          "orca_jax_compilations_after_warmup", "orca_jax_engine_ready", "orca_jax_max_num_seqs",
          "orca_jax_prefix_cache_queries_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, binary: str, tmp_path, target: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        config = tmp_path / "prometheus.yml"
        # 1 s scrapes and rule evaluations, so the test sees a pending alert within seconds.
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "orca-jax", "static_configs": [{"targets": [target]}]}],
        }))
        self.log = (tmp_path / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"], stdout=self.log, stderr=subprocess.STDOUT)

    def api(self, path: str, **params) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def wait_for(self, query: str, timeout: float = 15) -> list[dict]:
        """The query's result once it is non-empty (a rate needs two scrapes, then a rule evaluation)."""
        deadline = time.monotonic() + timeout
        while not (result := self.api("query", query=query)["result"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        return result

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited: {self.log_text()}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        pytest.fail(f"prometheus not ready after {timeout} s: {self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as log:
            return log.read()[-3000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.log.close()


def drive_load(server, stop: threading.Event, deadline: float, errors: list, clients: int = 16) -> list[threading.Thread]:
    """`clients` closed-loop clients of long generations (ignore_eos): twice the running batch of the
    tiny server (8 x 123 tokens wanted, 640 tokens of KV), so the cache stays nearly full."""
    def client():
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                status, _, body = http(server, "POST", "/v1/completions", {
                    "model": "tiny", "prompt": "1 2", "max_tokens": 120, "ignore_eos": True, "temperature": 0},
                    timeout=60)
            except OSError as error:
                errors.append(repr(error))
                return
            if status not in (200, 503):  # 503: the bounded queue is full, try again
                errors.append(f"{status} {body[:200]!r}")
                return

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    return threads


def test_prometheus_scrapes_the_server_and_the_kv_alert_goes_pending(tiny_server, tmp_path):
    binary = require_prometheus()
    target = tiny_server.url.removeprefix("http://")
    prometheus = Prometheus(binary, tmp_path, target)
    stop = threading.Event()
    threads, errors = [], []
    try:
        prometheus.wait_ready()
        threads = drive_load(tiny_server, stop, time.monotonic() + 50, errors)
        kv_alert, deadline = None, time.monotonic() + 45
        while kv_alert is None and time.monotonic() < deadline:
            time.sleep(1)
            kv_alert = next((alert for alert in prometheus.api("alerts")["alerts"]
                             if alert["labels"]["alertname"] == "OrcaJaxKVCacheAlmostFull"), None)
        usage = prometheus.api("query", query="max_over_time(orca_jax_kv_cache_usage[1m])")["result"]
        assert kv_alert is not None, f"the KV alert never became active; KV usage seen: {usage}"
        assert kv_alert["state"] == "pending", kv_alert  # `for: 3m` holds it back from firing
        assert kv_alert["labels"]["instance"] == target and kv_alert["labels"]["job"] == "orca-jax"
        stop.set()

        for name in SERIES:
            result = prometheus.api("query", query=name)["result"]
            assert result, f"no {name} series in Prometheus"
            for sample in result:
                assert sample["metric"]["job"] == "orca-jax" and sample["metric"]["instance"] == target, sample
        values = {name: float(prometheus.api("query", query=name)["result"][0]["value"][1])
                  for name in ("orca_jax_engine_ready", "orca_jax_max_num_seqs", "up")}
        assert values == {"orca_jax_engine_ready": 1, "orca_jax_max_num_seqs": 8, "up": 1}
        # The recording rules compute from the scraped series (running / max_num_seqs is within 0..1).
        utilisation = prometheus.wait_for("max_over_time(orca_jax:batch_utilisation:ratio[1m])")
        assert utilisation and 0 < float(utilisation[0]["value"][1]) <= 1, utilisation
        throughput = prometheus.wait_for("max_over_time(orca_jax:generation_tokens:rate1m[1m])")
        assert throughput and float(throughput[0]["value"][1]) > 0, throughput
        # Nothing else is wrong with this server: no other alert is active.
        others = [alert["labels"]["alertname"] for alert in prometheus.api("alerts")["alerts"]
                  if alert["labels"]["alertname"] not in ("OrcaJaxKVCacheAlmostFull", "OrcaJaxQueueGrowing",
                                                          "OrcaJaxPreempting")]
        assert others == [], others
        assert errors == [], errors
    finally:
        stop.set()
        for thread in threads:
            thread.join(70)
        prometheus.stop()
