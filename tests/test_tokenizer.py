"""The SmolLM2 tokenizer built from GGUF metadata, and the tiny model's word-level tokenizer."""

import pytest

ROUND_TRIP_TEXTS = [
    "The year 2024 had 366 days; 3.14159 is pi.",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}\n\n\tindent\r\n",
    "naïve café, Straße, 東京タワー, Привет, 🚀🤖 émojis and  double  spaces",
    "<|im_start|>user\nhello<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_digits_are_split_one_by_one(tokenizer):
    ids = tokenizer.encode("12345")
    assert [tokenizer.decode([i]) for i in ids] == list("12345")


def test_special_tokens_are_single_ids_and_skippable(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\nhi"
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2
    assert tokenizer.encode("hello")[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS


def test_prompt_ids_match_the_reference(tokenizer, smollm2_reference):
    for case in smollm2_reference["cases"]:
        assert tokenizer.encode(case["text"]) == case["prompt_ids"]
        assert tokenizer.decode(case["greedy_ids"]) == case["greedy_text"]


def test_chat_template_has_default_system_prompt(tokenizer, smollm2_reference):
    chat = [c for c in smollm2_reference["cases"] if c["kind"] == "chat"]
    assert chat
    for case in chat:
        assert tokenizer.apply_chat_template(case["messages"]) == case["text"]
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert "SmolLM" not in with_system


def test_bad_chat_messages_are_rejected_clearly(tokenizer):
    with pytest.raises(ValueError, match="messages is empty"):
        tokenizer.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[0\].*'content'"):
        tokenizer.apply_chat_template([{"role": "user"}])


def test_tiny_tokenizer(tiny_trained):
    tok = tiny_trained.tokenizer
    assert tok.encode("3 5 63") == [64, 3, 5, 63]  # <s> is added in front
    assert tok.decode([7, 9, 11, 65], skip_special_tokens=True) == "7 9 11"
