"""A step's per-row metadata for the sampler and the speculative verifier: one class each, built
in numpy on the host (engine/step_plan.py) and read as jax arrays on the device.

Each class is one dataclass used on both sides of the host/device contract. The host fills it with
numpy arrays and numpy scalars inside a `StepPlan`; the runner packs it (runner/packing.py) and its
compiled programs unpack the same class holding jax arrays. The device side registers each class
as a pytree with `jax.tree_util.register_dataclass` (model/sampler.py registers `SamplingMetadata`,
runner/speculation.py `SpeculationMetadata`; import the classes from there to use them under jax):
this module imports no jax, so the host side can build and send them (the engine thread, a
multi-host leader's plan codec) without it. Every field is a pytree leaf (or None: no leaf).

Shapes: R logit rows (one per sequence, plus one per draft token it verifies; R = S without
speculation), S_max sequence rows (KVLayout.max_num_seqs), V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# An array: numpy (or a numpy scalar) on the host, a jax array on the device.
Array = Any


@dataclasses.dataclass
class SamplingMetadata:
    """Per-request sampling parameters as [R] rows (model/sampler.py applies them)."""

    temperature: Array  # [R] float32; 0 = greedy
    top_k: Array  # [R] int32; 0 = off
    top_p: Array  # [R] float32; 1 = off
    min_p: Array  # [R] float32; 0 = off
    repetition_penalty: Array  # [R] float32; 1 = off
    presence_penalty: Array  # [R] float32
    frequency_penalty: Array  # [R] float32
    seeds: Array  # [R] uint32
    token_index: Array  # [R] int32: index of the token being sampled within the request's output
    stop_ids: Array  # [R, MAX_STOP_IDS] int32: EOS and stop tokens, -1 padded; suppressed while suppress_stop
    suppress_stop: Array  # [R] bool: fewer than min_tokens generated yet
    # [R, V] int32 occurrences of each token in the output so far, and [R, V] bool: the token occurs
    # in the prompt or the output (repetition penalty). In a host plan both are None when no row
    # uses penalties: the runner then passes zeros it keeps on the device, so such steps never ship them.
    output_counts: Array | None
    seen_tokens: Array | None
    use_penalties: Array  # [] bool: any row has a penalty (the [R, V] work is skipped otherwise)
    # [R, W] int32, W = ceil(V / 32); bit v % 32 of word v // 32: token v allowed. In a host plan None
    # when no row has a grammar: the runner then passes all-ones words it keeps on the device.
    token_bitmask: Array | None
    use_bitmask: Array  # [] bool: any row has a grammar
    bias_ids: Array  # [R, MAX_LOGIT_BIAS] int32: logit_bias entries, zero padded
    bias_values: Array  # [R, MAX_LOGIT_BIAS] float32
    use_logit_bias: Array  # [] bool
    need_logprobs: Array  # [] bool
    # [] int32: rows before the bucket's padding (the LM head's native matmul skips the others);
    # None: every row is real
    num_real_rows: Array | None = None


@dataclasses.dataclass
class SpeculationMetadata:
    """What a speculating runner's device needs to verify drafts and propose the next ones
    (runner/speculation.py)."""

    row_draft: Array  # [R] int32: the draft token the row's sample is checked against; -1: none
    row_first: Array  # [R] int32: the first logit row of the row's sequence
    row_seq: Array  # [R] int32: the row's sequence; padding: S_max (out of range)
    seq_first_row: Array  # [S_max] int32: each sequence's first logit row
    seq_history_len: Array  # [S_max] int32: tokens before the drafts (prompt + accepted outputs)
    seq_proposes: Array  # [S_max] bool: propose drafts for this sequence's next step
    any_proposes: Array  # [] bool
    # [S_max] int32: KV slots the sequence's pages hold; a draft model writes its proposals' K/V
    # ahead (runner/draft_model.py) and proposes no draft whose K/V would not fit
    seq_num_slots: Array
    # [S_max, max_pages] int32: the step's block tables. None in a host plan, which holds them once
    # (StepPlan.block_tables); the runner sets them when it packs the metadata for the device.
    block_tables: Array | None = None

    @classmethod
    def empty(cls, num_rows: int, max_num_seqs: int) -> "SpeculationMetadata":
        """A host plan's metadata with no drafts to verify and none to propose."""
        return cls(row_draft=np.full(num_rows, -1, np.int32), row_first=np.arange(num_rows, dtype=np.int32),
                   row_seq=np.full(num_rows, max_num_seqs, np.int32),
                   seq_first_row=np.zeros(max_num_seqs, np.int32), seq_history_len=np.zeros(max_num_seqs, np.int32),
                   seq_proposes=np.zeros(max_num_seqs, bool), any_proposes=np.bool_(False),
                   seq_num_slots=np.zeros(max_num_seqs, np.int32))
