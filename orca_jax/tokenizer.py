"""Tokenizer: an HF `tokenizers` object plus the metadata generation needs (bos/eos, chat template).

Saved beside a checkpoint as `tokenizer.json` and `tokenizer_config.json`. Chat templates are Jinja
(as in HF and GGUF files) and are rendered with jinja2 the way transformers does, without
transformers. This module does not import jax.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

# Used when a checkpoint has no template of its own: plain ChatML, no default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
    ):
        """`eos_token_id` is the one a template writes and `add_eos_token` adds; `extra_eos_token_ids`
        end a sequence too (ModelConfig.extra_eos_token_ids)."""
        self.hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = tuple(sorted(set(extra_eos_token_ids) - {eos_token_id}))
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a sequence."""
        return frozenset({self.eos_token_id, *self.extra_eos_token_ids}) - {None}

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) are parsed as
        such, as chat templates need.

        `add_bos` None follows the tokenizer's own rules (add_bos_token, add_eos_token), True adds BOS,
        False adds neither BOS nor EOS. A BOS the text already starts with (a chat template that writes
        `bos_token`) is not doubled: that text is dropped and the id added, as llama.cpp does, so a
        SentencePiece tokenizer marks the first word after it with its space prefix, as in training
        (SentencePiece encoded the text and the BOS id was put before it). An EOS likewise."""
        bos = self.bos_token_id is not None and (self.add_bos_token if add_bos is None else add_bos)
        eos = self.eos_token_id is not None and self.add_eos_token and add_bos is not False
        if bos:
            text = text.removeprefix(self._token_or_empty(self.bos_token_id))
        if eos:
            text = text.removesuffix(self._token_or_empty(self.eos_token_id))
        try:
            ids = self.hf.encode(text, add_special_tokens=False).ids
        except Exception as error:  # noqa: BLE001 - `tokenizers` raises a bare Exception naming what it lacked
            raise ValueError(f"the prompt {_clip(text)!r} cannot be encoded by this model's tokenizer "
                             f"({self._describe_model()}): {error}; write the prompt with the tokenizer's own "
                             f"vocabulary ({TOKENIZER_FILE}), or pass token ids") from error
        return [self.bos_token_id] * bos + ids + [self.eos_token_id] * eos

    def _describe_model(self) -> str:
        """E.g. "a WordLevel vocabulary of 66 tokens, no unknown token": the limit a prompt broke."""
        unknown = getattr(self.hf.model, "unk_token", None)
        has_unknown = unknown is not None and self.hf.token_to_id(unknown) is not None
        return (f"a {type(self.hf.model).__name__} vocabulary of {self.vocab_size} tokens, "
                f"{f'unknown token {unknown!r}' if has_unknown else 'no unknown token'}")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, *,
                            tools: Sequence[dict] | None = None, template: str | None = None, **kwargs) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}], plus any keys the template reads, such as
        tool_calls) into prompt text. `template` overrides the tokenizer's own; `tools` and `kwargs`
        are template variables, as transformers passes them."""
        if not messages:
            raise ValueError("messages is empty; pass at least one {'role': ..., 'content': ...} message")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {message!r}")
        template = _compile_template(template or self.effective_chat_template)
        return template.render(
            **kwargs,
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_or_empty(self.bos_token_id),
            eos_token=self._token_or_empty(self.eos_token_id),
        )

    @property
    def effective_chat_template(self) -> str:
        return self.chat_template or CHATML_TEMPLATE

    def _token_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.hf.id_to_token(token_id) or "")

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.hf.save(str(directory / TOKENIZER_FILE))
        config = {
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "eos_token_ids": sorted(self.eos_token_ids),
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "chat_template": self.chat_template,
        }
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "Tokenizer":
        directory = Path(directory)
        config_file = directory / CONFIG_FILE
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(
            HFTokenizer.from_file(str(directory / TOKENIZER_FILE)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            extra_eos_token_ids=config.get("eos_token_ids", ()),  # (absent in checkpoints made before it)
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=config.get("chat_template"),
        )


def check_chat_template(source: str) -> None:
    """ValueError naming the line of a Jinja syntax error."""
    try:
        _compile_template(source)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"not a valid Jinja template: {error.message} (line {error.lineno})") from error


def _compile_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in (tests/test_chat_templates.py holds
    them to its output byte for byte): trimmed blocks, loop controls ({% break %}, {% continue %}),
    a `tojson` that keeps non-ASCII and HTML characters as they are (jinja's own escapes them),
    `raise_exception` and `strftime_now`."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    return env.from_string(source)


def byte_level_bpe(
    tokens: Sequence[str],
    merges: Sequence[str],
    special_token_ids: Sequence[int],
    split_regexes: Sequence[str],
    ignore_merges: bool = False,
    user_defined_ids: Sequence[int] = (),
) -> HFTokenizer:
    """A GPT-2 style byte-level BPE tokenizer from a vocabulary and "a b" merge lines.

    `special_token_ids` are matched whole in the text and skipped by `decode(skip_special_tokens=True)`;
    `user_defined_ids` (spelled as plain text, not in bytes: GPT-NeoX's runs of spaces) are matched
    whole and kept. The rest of the text is cut by each of `split_regexes` in turn (every match and every stretch between matches
    a piece), then each piece is spelled in bytes and merged. `ignore_merges` takes a piece that is a
    token of the vocabulary as that token without merging (Llama 3's tokenizer.json says so).
    """
    if not split_regexes:
        raise ValueError("byte_level_bpe needs at least one split regex (GPT-2's, for instance)")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                ignore_merges=ignore_merges))
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False) for regex in split_regexes]
    hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special_token_ids])
    hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined_ids])
    return hf


SPACE = "\u2581"  # "▁": how SentencePiece pieces spell a space


def sentencepiece_bpe(
    tokens: Sequence[str],
    merges: Sequence[tuple[str, str]],
    *,
    special_token_ids: Sequence[int],
    user_defined_ids: Sequence[int],
    unk_token_id: int | None,
    space_prefix: bool,
) -> HFTokenizer:
    """A SentencePiece BPE tokenizer (Llama 2, Mistral, TinyLlama, Gemma, Phi-3) from its pieces.

    Spaces are spelled "▁" and nothing else is normalized; a character the vocabulary lacks is spelled
    by its UTF-8 bytes (the `<0x41>` pieces). `special_token_ids` (control tokens) are matched whole in
    the text and skipped by `decode(skip_special_tokens=True)`; `user_defined_ids` are matched whole
    and kept.

    `space_prefix` (SentencePiece's "dummy prefix") puts a space before every stretch of text between
    the tokens matched whole, also before a stretch that starts with a space (" Hello" is "▁▁Hello"):
    SentencePiece itself adds it to every text it encodes, the models were trained on text encoded so
    a stretch at a time (Meta's Llama 2 chat code encodes each turn on its own), and llama.cpp does the
    same. transformers' GGUF loader (and HF's non-legacy Llama tokenizer) adds it only at the start,
    and not before a space; that gives other ids for such texts.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = tokens[unk_token_id] if unk_token_id is not None else None
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=list(merges), unk_token=unk, fuse_unk=True, byte_fallback=True))
    # A normalizer runs on each stretch of text the tokens matched whole leave, and Prepend always
    # prepends (Metaspace's prepend would skip a stretch that starts with a space). No pre-tokenizer:
    # the text stays one word, so merges may cross spaces as SentencePiece's do.
    steps = [normalizers.Prepend(SPACE)] if space_prefix else []
    hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:  # the prefix the encoder added is not part of the text
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    hf.decoder = decoders.Sequence(decode)
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special_token_ids])
    hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined_ids])
    return hf


def merges_from_vocab(tokens: Sequence[str], priorities: Sequence[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (it stores scores, not merges): every way of
    cutting a token into two tokens, ranked by the token's priority (its score: higher merges first),
    then by the longer left piece, then the longer right one, then by the tokens' order.

    This is the order transformers derives (its GGUF loader, `generate_merges`), so the ids are its ids;
    SentencePiece itself merges the adjacent pair whose joined piece scores highest, the same ranking
    up to ties."""
    vocab = set(tokens)
    found = []
    for token, priority in dict(zip(tokens, priorities)).items():
        found += [(priority, token[:k], token[k:]) for k in range(1, len(token))
                  if token[:k] in vocab and token[k:] in vocab]
    # sort() is stable, also in reverse: ties keep the tokens' order.
    found.sort(key=lambda merge: (merge[0], len(merge[1]), len(merge[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def _clip(text: str, limit: int = 60) -> str:
    """The start of a long prompt, for an error message."""
    return text if len(text) <= limit else text[:limit] + "..."
