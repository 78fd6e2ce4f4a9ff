"""The server, unchanged, on a tensor-parallel engine: SmolLM2 over 3 devices through HTTP and the
official `openai` client, giving the reference greedy answer, streamed and not."""

import openai
import pytest

from orca_jax.engine.async_engine import AsyncLLMEngine
from orca_jax.server.state import ServerSettings

from ..engine.conftest import SMOLLM2_LIMITS, make_engine
from .conftest import ServerThread


@pytest.fixture(scope="module")
def tp3_server(smollm2_tp3_runner, smollm2):
    assert smollm2_tp3_runner.stages[0].mesh.size == 3
    server = ServerThread(lambda: AsyncLLMEngine(make_engine(smollm2_tp3_runner, smollm2, "chunked", **SMOLLM2_LIMITS)),
                          ServerSettings(model_name="smollm2")).start()
    yield server
    assert server.stop() == 0


@pytest.mark.slow
def test_chat_on_a_tp3_engine_gives_the_reference_answer(tp3_server, smollm2_reference):
    case = next(c for c in smollm2_reference["cases"] if c["kind"] == "chat")
    client = openai.OpenAI(base_url=tp3_server.url + "/v1", api_key="unused")
    params = dict(model="smollm2", messages=case["messages"], max_tokens=len(case["greedy_ids"]), temperature=0)
    chat = client.chat.completions.create(**params)
    assert chat.choices[0].message.content == "The primary colors are: Red, Blue, and Yellow."
    assert chat.choices[0].finish_reason == "stop"
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client.chat.completions.create(**params, stream=True) if chunk.choices)
    assert streamed == chat.choices[0].message.content
    assert tp3_server.engine.runner.num_compilations_after_warmup == 0
