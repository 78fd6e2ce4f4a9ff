"""Incremental detokenization with the real SmolLM2 tokenizer: streamed pieces add up to the text."""

import pytest

from orca_jax.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "naïve café — 東京タワー 🚀🤖 ok",
    "def f(x):\n    return x ** 2  # 平方\n",
    "Numbers 12345 and 3.14159",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_the_whole_text(smollm2, text):
    tok = smollm2.tokenizer
    prompt = tok.encode("Say:")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True, stop=[])
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == detok.text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # half characters are held back, never emitted


def test_stop_string_split_across_tokens_is_found_and_cut(smollm2):
    tok = smollm2.tokenizer
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=["東京"])
    for t in tok.encode("go to 東京タワー now"):
        detok.add(t)
        if detok.stopped_by:
            break
    assert detok.stopped_by == "東京" and detok.text == "go to "
