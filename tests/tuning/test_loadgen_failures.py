"""The load generator times a failed request as it does a served one (when it was due, when its POST
went out), so that bench/ttft_breakdown.py can match it to the engine's trace and name it."""

import http.server
import math
import threading

from orca_jax.tuning.loadgen import replay


class Refusing(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b"prompt too long"
        self.send_response(400)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_refused_request_keeps_its_due_and_sent_times():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (m,), _ = replay(f"http://127.0.0.1:{server.server_address[1]}", [([1, 2, 3], 4)], [0.05])
    finally:
        server.shutdown()
        server.server_close()
    assert not m.ok and m.error == "400: prompt too long"
    assert math.isfinite(m.scheduled_at) and m.scheduled_at <= m.sent_at < m.scheduled_at + 1.0
    assert math.isnan(m.first_at)
