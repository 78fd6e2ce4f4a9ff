"""Incremental detokenization and stop strings. No jax.

Decoding one token at a time is wrong for byte-level BPE (a character can span tokens) and for
tokenizers that add spaces between words, so each step decodes a short window of recent tokens and
emits only text past what that window already produced (vLLM's prefix/read offsets). Text that ends
in an incomplete UTF-8 character (U+FFFD) is held back until the next token completes it.
"""

from __future__ import annotations

from orca_jax.tokenizer import Tokenizer

# Prompt tokens kept as left context, so the first output token decodes as it would mid-text.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool, stop: list[str],
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stopped_by: str | None = None

    def add(self, token: int) -> str:
        """Appends a token; returns the new text (possibly empty). After a stop string is found,
        `stopped_by` is set and the text is cut there."""
        self.ids.append(token)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = decode(self.ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        new_text = full_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._append(new_text)

    def _append(self, new_text: str) -> str:
        before = len(self.text)
        self.text += new_text
        if self.stop:
            # A stop string may straddle the old text and the new: search from just before it.
            search_from = max(0, before - max(len(s) for s in self.stop) + 1)
            hits = [(self.text.find(s, search_from), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, stop = min(hits)
                self.text = self.text[:index + len(stop) if self.include_stop else index]
                self.stopped_by = stop
        return self.text[before:]
