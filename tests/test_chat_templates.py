"""Chat templates render byte for byte as transformers' `apply_chat_template` renders them
(expected.json made by tests/fixtures/chat_templates/make_expected.py with transformers): a system
prompt, several turns, tool calls, tool results and tool definitions whose JSON holds non-ASCII
text and HTML-special characters (transformers' `tojson` keeps them as they are)."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer, models

from orca_jax.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
DATA = json.loads((FIXTURES / "expected.json").read_text())


@pytest.mark.parametrize("name, conversation", [("chatml_tools", "with_tools"), ("mistral_tools", "with_tools"),
                                                ("gemma", "alternating")])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_templates_render_as_transformers_does(name, conversation, generation_prompt):
    hf = HFTokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "x": 2}, unk_token="x"))
    tokenizer = Tokenizer(hf, bos_token_id=0, eos_token_id=1, chat_template=(FIXTURES / f"{name}.jinja").read_text())
    tools = DATA["tools"] if conversation == "with_tools" else None
    text = tokenizer.apply_chat_template(DATA["messages"][conversation], add_generation_prompt=generation_prompt,
                                         tools=tools)
    assert text == DATA["expected"][f"{name}/{generation_prompt}"]


def test_a_template_error_names_the_template_message():
    hf = HFTokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "x": 2}, unk_token="x"))
    tokenizer = Tokenizer(hf, bos_token_id=0, eos_token_id=1, chat_template=(FIXTURES / "gemma.jinja").read_text())
    with pytest.raises(ValueError, match="roles must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
