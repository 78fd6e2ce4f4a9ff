"""bench_single_stream's llama-server side (its runs alternate with ours in compare_llama_cpp.sh):
one greedy request of the same prompt and length, and the server's own decode timing read back."""

import http.server
import json
import threading

import pytest


class FakeLlamaServer(http.server.BaseHTTPRequestHandler):
    """Answers /completion as llama-server does (only the fields the bench reads) and keeps the body."""

    bodies: list[dict] = []

    def do_POST(self):
        assert self.path == "/completion"
        FakeLlamaServer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        answer = json.dumps({"content": "...", "timings": {"predicted_per_second": 123.5}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def server_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeLlamaServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeLlamaServer.bodies = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_one_request_of_our_prompt_and_length_and_its_own_timing(server_url):
    import bench_single_stream

    assert bench_single_stream.llama_server_tok_s(server_url) == 123.5
    (body,) = FakeLlamaServer.bodies
    # What our runs generate: the same prompt, 128 greedy tokens past any end of text, no cached prompt.
    assert body == {"prompt": bench_single_stream.PROMPT, "n_predict": 128, "temperature": 0, "ignore_eos": True,
                    "cache_prompt": False}
