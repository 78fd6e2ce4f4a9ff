"""Structured outputs on the host: a request's constraint -> a grammar matcher -> one token bitmask per step.

The grammar engine is llguidance (bench/bench_grammar.py measured it against xgrammar on SmolLM2's
49152-token vocabulary: ~1 ms to compile a schema against xgrammar's 9-18 ms, ~10 us per mask
against ~2 us, both far below a step; xgrammar also needs torch, llguidance is one 3 MB wheel).

How a constrained request runs (no jax here; the mask is applied by the sampler, on device):

1. `GrammarCompiler.compile` turns StructuredOutputsParams into an llguidance grammar and checks it
   (a bad schema, regex or grammar is a GrammarError naming the problem, which the server answers
   with a 400). Compiled matchers are cached by constraint, so a repeated schema costs a copy.
2. Each sample of the request holds its own `Grammar` (the matcher's state along its output).
3. Building a step, `fill_bitmask` writes the tokens the grammar allows next into the request's
   row of the step's [S, ceil(V/32)] int32 bitmask (bit v of word v // 32; rows without a grammar
   stay all ones). EOS is allowed only where the grammar is complete.
4. After the step, the engine `accept`s the sampled token; once `finished` (nothing but EOS could
   follow) the request stops at once, without spending a step on the EOS.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import TYPE_CHECKING

import numpy as np

from orca_jax.engine.json_schema import BOUNDED_OBJECT, close_objects
from orca_jax.optional import import_optional
from orca_jax.sampling_params import StructuredOutputsParams
from orca_jax.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance

# JSON comes out as json.dumps writes it: ", " and ": ", no other whitespace (llguidance's default is
# any run of it). With free whitespace a small model can pad with newlines until max_tokens instead
# of closing the object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 128  # compiled constraints kept (a request that repeats one skips the compile)


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message says what is wrong."""


def _llguidance():
    """llguidance, imported by the first constrained request: a server that never sees one runs
    without it (orca_jax/optional.py). Missing, it is a GrammarError: the request is refused, naming it."""
    return import_optional("llguidance", "structured outputs (a JSON schema, regex, choice or grammar)", GrammarError)


class Grammar:
    """One sample's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into `row` ([ceil(V/32)] int32, contiguous)."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> None:
        """Advances past a sampled token (always one the bitmask allowed)."""
        self._matcher.consume_token(token)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (draft tokens) the grammar allows in a row from here; changes nothing."""
        return self._matcher.validate_tokens(tokens) if tokens else 0

    def fill_bitmask_after(self, row: np.ndarray, tokens: list[int]) -> None:
        """The bitmask of the state after `tokens` (drafts before a verifying row; a valid prefix),
        leaving the grammar where it was."""
        if not tokens:
            return self.fill_bitmask(row)
        self._matcher.consume_tokens(tokens)
        try:
            self.fill_bitmask(row)
        finally:
            self._matcher.rollback(len(tokens))

    @property
    def finished(self) -> bool:
        """Complete, and nothing but EOS may follow (or the matcher failed: generating on is pointless)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """Compiles constraints against one tokenizer. Thread-safe: the server checks constraints on its
    event loop's worker threads while the engine thread makes matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, disable_additional_properties: bool = True):
        self._tokenizer = tokenizer
        self.disable_additional_properties = disable_additional_properties  # for requests that leave it None
        self._vocab_size = vocab_size  # the model's (the mask covers every logit), >= the tokenizer's
        self._lltokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.4 s)
        self._cache: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the constraint's grammar; GrammarError if it cannot be compiled."""
        strict = spec.disable_additional_properties
        grammar = llguidance_grammar(spec, self.disable_additional_properties if strict is None else strict)
        llguidance = _llguidance()
        with self._lock:
            matcher = self._cache.get(grammar)
            if matcher is not None:
                self._cache.move_to_end(grammar)
                return matcher.deep_copy()
            if self._lltokenizer is None:
                try:
                    self._lltokenizer = llguidance.LLTokenizer(self._tokenizer.hf.to_str(), n_vocab=self._vocab_size,
                                                               eos_token=self._tokenizer.eos_token_id)
                except ValueError as error:  # llguidance reads byte-level BPE and similar, not every tokenizer
                    raise GrammarError(f"structured outputs are not available for this model: the grammar engine "
                                       f"cannot read its tokenizer ({error})") from error
            lltokenizer = self._lltokenizer
        matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)  # releases the GIL while compiling
        if matcher.is_error():
            raise GrammarError(f"{describe(spec)} cannot be compiled: {matcher.get_error().strip()}")
        with self._lock:  # copies are made under the lock: a cached matcher is shared by both threads
            self._cache[grammar] = matcher
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return matcher.deep_copy()

    def grammar(self, spec: StructuredOutputsParams) -> Grammar:
        return Grammar(self.compile(spec))


def llguidance_grammar(spec: StructuredOutputsParams, disable_additional_properties: bool = True) -> str:
    """The constraint in llguidance's grammar format (not yet checked against the tokenizer).
    `disable_additional_properties`: objects get only the keys their schema lists, json_object is
    bounded (engine/json_schema.py)."""
    llguidance = _llguidance()
    try:
        if spec.json_object:
            schema = BOUNDED_OBJECT if disable_additional_properties else {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            if disable_additional_properties:
                schema = close_objects(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark as it is; GBNF converted to Lark
    except ValueError as error:  # not JSON, or a GBNF the converter could not read
        raise GrammarError(f"{describe(spec)} cannot be compiled: {error}") from error


def describe(spec: StructuredOutputsParams) -> str:
    if spec.json is not None:
        return "the JSON schema"
    if spec.json_object:
        return "the JSON object grammar"
    return f"the {'regex' if spec.regex is not None else 'choice' if spec.choice is not None else 'grammar'}"
