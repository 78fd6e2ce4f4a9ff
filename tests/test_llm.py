"""The offline API as users call it: LLM(...).generate / .chat."""

import pytest

from orca_jax import LLM, SamplingParams
from orca_jax.config import REPO_ROOT
from orca_jax.engine.engine import RequestRejected


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM(REPO_ROOT / "checkpoints" / "tiny", max_num_seqs=4, max_num_batched_tokens=16,
               token_buckets=[16], seq_buckets=[4], show_progress=False)


def test_generate_keeps_input_order_and_accepts_text_or_ids(tiny_llm):
    prompts = ["3 5", {"prompt_token_ids": [64, 10, 13]}, "60 61", "0 4", "1 2"]  # more than max_num_seqs
    params = [SamplingParams(temperature=0, max_tokens=3)] * 4 + [SamplingParams(temperature=0, max_tokens=1)]
    outputs = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text.strip() for o in outputs] == ["7 9 11", "16 19 22", "62 63", "8 12 16", "3"]
    assert outputs[1].prompt_token_ids == [64, 10, 13]
    assert outputs[2].outputs[0].finish_reason == "stop"  # </s> after 63
    assert outputs[0].outputs[0].finish_reason == "length"
    for out in outputs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert tiny_llm.num_compilations_after_warmup == 0


def test_a_bad_request_rejects_the_batch_before_anything_is_queued(tiny_llm):
    with pytest.raises(RequestRejected, match="context length of 128"):
        tiny_llm.generate(["3 5", "1 2"], [SamplingParams(max_tokens=3), SamplingParams(max_tokens=500)], use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        tiny_llm.generate(["3 5", "1 2"], [SamplingParams()] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny_llm.generate([{"text": "3 5"}], use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_no_program_runs_for_the_first_time_inside_generate():
    # Two token and two row buckets: warm-up runs only the smallest pair, so without the first runs
    # at construction the job below would run the others for the first time.
    llm = LLM(REPO_ROOT / "checkpoints" / "tiny", max_num_seqs=4, max_num_batched_tokens=16,
              token_buckets=[4, 16], seq_buckets=[2, 4], show_progress=False)
    outputs = llm.generate(["3 5 7 9", "1 2", "10 13", "0 4"], SamplingParams(temperature=0, max_tokens=3),
                           use_tqdm=False)
    assert [o.outputs[0].text.strip() for o in outputs] == ["11 13 15", "3 4 5", "16 19 22", "8 12 16"]
    used = set(llm.runner.stats.buckets)  # (tokens, rows) per step: the job used programs warm-up did not run
    assert 16 in {tokens for tokens, _ in used} and 4 in {rows for _, rows in used}
    assert llm.runner.stats.first_runs == 0


def test_a_prompt_the_tokenizer_cannot_encode_is_a_value_error_naming_it(tiny_llm):
    # The tiny model's vocabulary is numbers and a few operators, with no unknown token.
    with pytest.raises(ValueError, match=r"the prompt 'Hello' cannot be encoded .* WordLevel vocabulary of 66 "
                                         r"tokens, no unknown token"):
        tiny_llm.generate(["3 5", "Hello"], use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()  # the batch was refused whole


def test_chat_and_text_with_smollm2(smollm2, smollm2_reference):
    llm = LLM("smollm2-135m-instruct", max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[64],
              seq_buckets=[4], kv_cache_memory=64 << 20, max_model_len=1024, show_progress=False)
    case = next(c for c in smollm2_reference["cases"] if c["kind"] == "chat")
    params = SamplingParams(temperature=0, max_tokens=len(case["greedy_ids"]))
    chat = llm.chat(case["messages"], params, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == case["greedy_ids"]
    assert chat.outputs[0].text == "The primary colors are: Red, Blue, and Yellow."
    text_case = smollm2_reference["cases"][0]
    out = llm.generate(text_case["prompt"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert out.outputs[0].text == llm.get_tokenizer().decode(text_case["greedy_ids"][:5])


def test_max_model_len_from_the_config_bounds_requests():
    from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig

    config = EngineConfig(model=str(REPO_ROOT / "checkpoints" / "tiny"), max_model_len=32,
                          cache=CacheConfig(page_size=4, kv_cache_memory=1 << 20),
                          scheduler=SchedulerConfig(policy="orca", max_num_seqs=4, max_num_batched_tokens=16))
    llm = LLM(config=config, token_buckets=[16], seq_buckets=[4], show_progress=False)
    assert llm.engine.max_model_len == 32 and llm.runner.max_pages_per_seq == 8
    with pytest.raises(RequestRejected, match="context length of 32 tokens"):
        llm.generate(["3 5"], SamplingParams(max_tokens=40), use_tqdm=False)
    out = llm.generate(["3 5"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].text.strip() == "7 9 11 13"


def test_config_and_engine_keywords_together_are_refused():
    from orca_jax.config import EngineConfig

    with pytest.raises(ValueError, match=r"\['max_num_seqs', 'tensor_parallel_size'\] would be ignored"):
        LLM(config=EngineConfig(), max_num_seqs=4, tensor_parallel_size=3)


def test_bfloat16_weights_and_kv_pages_give_the_counting_answers():
    """dtype="bfloat16": parameters, activations and KV pages in bf16 (what a GPU user runs); the
    trained tiny model's answers have wide margins, so they survive the rounding."""
    import jax.numpy as jnp

    llm = LLM(REPO_ROOT / "checkpoints" / "tiny", dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=16,
              token_buckets=[16], seq_buckets=[4], show_progress=False)
    stage = llm.runner.stages[0]
    assert stage.kv_cache.k[0].dtype == jnp.bfloat16
    assert stage.params["layers"][0]["attn"]["q"]["kernel"][...].dtype == jnp.bfloat16
    outputs = llm.generate(["3 5", "10 13", "60 61"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.outputs[0].text.strip() for o in outputs] == ["7 9 11 13", "16 19 22 25", "62 63"]
    assert llm.num_compilations_after_warmup == 0
