"""OpenAI response bodies built from RequestOutputs: choices, logprobs, usage, stream deltas. No jax.

Pure functions and one small state machine (ChoiceDeltas), so the handlers only move bytes.
"""

from __future__ import annotations

import time
import uuid

from orca_jax.outputs import CompletionOutput, Logprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def envelope(response_id: str, kind: str, model: str, choices: list[dict], usage: dict | None = None,
             with_usage_field: bool = False) -> dict:
    body = {"id": response_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            "system_fingerprint": None}
    if usage is not None or with_usage_field:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def tool_finish_reason(finish_reason: str | None) -> str | None:
    """A choice that made tool calls finishes with "tool_calls", unless it was cut by the length."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _token_text(entry: Logprob, token: int) -> str:
    return entry.decoded_token if entry.decoded_token is not None else f"<{token}>"


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], text_offset: int) -> dict:
    """The legacy completions format: parallel lists per generated token."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        text = _token_text(entry[token], token)
        tokens.append(text)
        token_logprobs.append(entry[token].logprob)
        top.append({_token_text(lp, t): lp.logprob for t, lp in entry.items() if lp.rank is not None})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]]) -> dict:
    """The chat format: one object per generated token with its top alternatives."""
    def item(token: int, lp: Logprob) -> dict:
        text = _token_text(lp, token)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token, entry in zip(token_ids, entries):
        ranked = sorted(((lp.rank, t, lp) for t, lp in entry.items() if lp.rank is not None))
        content.append({**item(token, entry[token]), "top_logprobs": [item(t, lp) for _, t, lp in ranked]})
    return {"content": content}


class ChoiceDeltas:
    """Turns a sample's growing CompletionOutput into stream deltas.

    With stop strings, the last (longest stop - 1) characters are held back until the sample
    finishes: the detokenizer cuts a stop string that straddles two steps, and text already sent
    cannot be taken back."""

    def __init__(self, stop: list[str]):
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text_sent = 0
        self.tokens_sent = 0
        self.finished = False

    def advance(self, completion: CompletionOutput) -> tuple[str, list[int], list[dict] | None, str | None] | None:
        """(new text, new token ids, their logprob entries, finish reason), or None if nothing is new."""
        if self.finished:
            return None
        done = completion.finish_reason is not None
        end = len(completion.text) if done else max(self.text_sent, len(completion.text) - self.holdback)
        text = completion.text[self.text_sent:end]
        tokens = completion.token_ids[self.tokens_sent:]
        entries = None if completion.logprobs is None else completion.logprobs[self.tokens_sent:]
        if not text and not tokens and not done:
            return None
        self.text_sent, self.tokens_sent, self.finished = end, len(completion.token_ids), done
        return text, tokens, entries, completion.finish_reason
