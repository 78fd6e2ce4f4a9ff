"""Generation by full recompute: every step re-runs the whole sequence through the decoder.

No KV cache and no batching, so it is O(n^2) and slow, but simple enough to trust: it is the
oracle the engine's outputs are compared against. Sequences are padded to power-of-two buckets so
a generation compiles once per bucket, not once per length.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orca_jax.model.decoder import Decoder

MIN_BUCKET = 16
PAD_SEGMENT = 1  # the sequence is segment 0; padding sits in a segment of its own


class RecomputeGenerator:
    def __init__(self, model: Decoder):
        self.config = model.config
        graphdef, self._state = nnx.split(model)

        @jax.jit
        def last_logits(state, token_ids, positions, segment_ids, last):
            return nnx.merge(graphdef, state)(token_ids, positions, segment_ids, last[None])[0]

        self._last_logits = last_logits

    def next_token_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 logits [V] for the token after `token_ids`."""
        n = len(token_ids)
        bucket = max(MIN_BUCKET, 1 << (n - 1).bit_length())
        ids = np.zeros(bucket, np.int32)
        ids[:n] = token_ids
        positions = np.arange(bucket, dtype=np.int32)
        segments = np.where(np.arange(bucket) < n, 0, PAD_SEGMENT).astype(np.int32)
        logits = self._last_logits(self._state, ids, positions, segments, jnp.int32(n - 1))
        return np.asarray(logits)

    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> Iterator[int]:
        """Yields up to `max_new_tokens` greedy tokens; stops after yielding a stop token."""
        if not prompt_ids:
            raise ValueError("prompt is empty; pass at least one token")
        limit = self.config.max_position
        if len(prompt_ids) + max_new_tokens > limit:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context length of {limit} tokens; shorten the prompt or lower max_new_tokens"
            )
        tokens = list(prompt_ids)
        for _ in range(max_new_tokens):
            token = int(np.argmax(self.next_token_logits(tokens)))
            tokens.append(token)
            yield token
            if token in stop_token_ids:
                return
