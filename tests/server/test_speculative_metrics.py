"""/metrics of a server that speculates: vLLM's spec_decode_* counters, from a real HTTP request."""

from orca_jax.checkpoint.train_tiny import counting_sequence
from orca_jax.engine.async_engine import AsyncLLMEngine
from orca_jax.server.state import ServerSettings

from ..engine.conftest import TINY_LIMITS, make_engine
from ..engine.test_speculative_engine import SPEC
from .conftest import ServerThread, http


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_metrics_count_drafts_and_accepted_tokens(tiny_spec_runner, tiny_trained):
    server = ServerThread(lambda: AsyncLLMEngine(make_engine(tiny_spec_runner, tiny_trained, "chunked", **TINY_LIMITS,
                                                             speculative_config=SPEC)),
                          ServerSettings(model_name="tiny")).start()
    try:
        prompt = counting_sequence(2, 1)[:6] + counting_sequence(2, 1)[1:4]  # repeats itself: a draft is accepted
        status, _, _ = http(server, "POST", "/v1/completions",
                            {"model": "tiny", "prompt": prompt, "max_tokens": 30, "temperature": 0})
        assert status == 200
        _, _, body = http(server, "GET", "/metrics")
        text = body.decode()
        stats = server.engine.drafts.stats
        assert stats.num_accepted_tokens > 0
        assert metric(text, "orca_jax_spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
        assert metric(text, "orca_jax_spec_decode_num_drafts_total") == stats.num_drafts
        assert metric(text, "orca_jax_spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
        assert metric(text, "orca_jax_spec_decode_num_accepted_tokens_per_pos_total") == stats.num_accepted_tokens
        assert 'orca_jax_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text
    finally:
        assert server.stop() == 0
