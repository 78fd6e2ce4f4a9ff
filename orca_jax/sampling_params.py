"""SamplingParams: how to pick tokens and when to stop, per request. Shaped like vLLM's.

Validation happens on construction and raises ValueError naming the field and the valid range.
This module does not import jax.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # the runner always computes this many top logprobs; a request may ask for fewer
MAX_STOP_IDS = 16  # EOS + stop_token_ids that can be suppressed on device while min_tokens is not reached
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit): a fixed [S, 300] array on device
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token, +100 makes it the only likely choice


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's StructuredOutputsParams): exactly one of the fields.

    Compiled by the engine (engine/structured_output.py) into a grammar whose token bitmask masks
    the logits on device at every step; the request stops when the grammar is complete."""

    json: dict | str | None = None  # a JSON schema (as an object or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a context-free grammar: Lark (llguidance's dialect) or GBNF
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    # An option, not a constraint (vLLM's name). None: the engine's setting (by default true: an
    # object schema that does not say additionalProperties generates only the keys it lists, and
    # json_object is bounded). False: extra keys wherever JSON Schema allows them.
    disable_additional_properties: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, regex, choice, grammar, json_object; "
                             f"got {given or 'none'}")
        if self.disable_additional_properties not in (None, True, False):
            raise ValueError(f"structured outputs disable_additional_properties must be true or false, "
                             f"got {self.disable_additional_properties!r}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured outputs json must be a JSON schema (an object), got {self.json!r}")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured outputs choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured outputs {name} must be a non-empty string, got {value!r}")


@dataclass
class SamplingParams:
    n: int = 1  # independent samples of the prompt
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) means off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output (CTRL style)
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    seed: int | None = None  # None: the engine draws one, so the request is still batch-invariant
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled token)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._check_int("n", 1)
        self._check_int("max_tokens", 1)
        self._check_int("min_tokens", 0)
        self._check_int("top_k", 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        self._check_float("temperature", 0.0, None)
        self._check_float("top_p", 0.0, 1.0, open_low=True)
        self._check_float("min_p", 0.0, 1.0)
        self._check_float("repetition_penalty", 0.0, None, open_low=True)
        self._check_float("presence_penalty", -2.0, 2.0)
        self._check_float("frequency_penalty", -2.0, 2.0)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None:
            self._check_int("logprobs", 0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs={self.logprobs} is above the maximum of {MAX_LOGPROBS}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logit_bias is not None:
            self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        """Ids must be integers (the vocabulary bound is the engine's to check); values in range."""
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are supported")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not isinstance(bias, (int, float)) or isinstance(bias, bool) \
                    or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100]; token {token} has {bias!r}")

    def _check_int(self, name: str, low: int) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    def _check_float(self, name: str, low: float, high: float | None, open_low: bool = False) -> None:
        value = getattr(self, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{name} must be a number, got {value!r}")
        too_low = value <= low if open_low else value < low
        if too_low or (high is not None and value > high):
            bracket = "(" if open_low else "["
            upper = f"{high}]" if high is not None else "inf)"
            raise ValueError(f"{name} must be in {bracket}{low}, {upper}, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)
