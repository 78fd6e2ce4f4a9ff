"""A step's host arrays as the compiled programs take them: the layers' token arrays (`StepInputs`)
and the head's sampling and speculation metadata, each packed into one buffer per dtype
(packing.py). The packed numpy buffers go into the compiled call as they are: the call places them
on the stage's devices for ~5 us an array, where `jax.device_put` costs ~0.1 ms of host time an
array (jax 0.10, AMD EPYC Zen 3).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Array, Int

from orca_jax.config import ModelConfig
from orca_jax.engine.step_plan import StepPlan, bitmask_width
from orca_jax.model.attention import AttentionMetadata
from orca_jax.model.rotary import HostRotations
from orca_jax.model.sampler import SamplingMetadata
from orca_jax.runner.packing import Packed, pack


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """A StepPlan's token arrays as the layers' programs take them: one pytree, packed (packing.py)
    and placed on a stage's devices by the program's call (see step_plan.StepPlan for the fields'
    meaning)."""

    token_ids: Int[Array, " T"]
    token_source: Int[Array, " T"]  # -1, or the previous step's logit row whose sampled token it is
    attention: AttentionMetadata  # positions, segment ids, slots; block tables and KV lengths [S_max]
    logits_index: Int[Array, " R_max"]

    @classmethod
    def of(cls, plan: StepPlan, rotations: HostRotations | None = None) -> "StepInputs":
        """`rotations`: the model's, to ship the step's rotary cos and sin (else the program computes them)."""
        attention = AttentionMetadata(positions=plan.positions, segment_ids=plan.segment_ids,
                                      slot_mapping=plan.slot_mapping, block_tables=plan.block_tables,
                                      kv_lens=plan.kv_lens,
                                      # Static batches' finished members are computed, as FasterTransformer's.
                                      num_tokens=np.int32(plan.num_real_tokens + plan.num_padding_seqs),
                                      rotations=None if rotations is None else rotations(plan.positions))
        return cls(token_ids=plan.token_ids, token_source=plan.token_source, attention=attention,
                   logits_index=plan.logits_index)


class LayersInputs:
    """A plan's token arrays, packed for a stage's layers program, with the step's rotary cos and
    sin for the model's rotary kinds (rotary.py)."""

    def __init__(self, config: ModelConfig):
        self.rotations = HostRotations(config)

    def __call__(self, plan: StepPlan) -> Packed:
        return pack(StepInputs.of(plan, self.rotations))


class HeadInputs:
    """The head's packed metadata for a plan. Steps without penalties take [S, V] zero arrays, and
    steps without a grammar an all-ones token bitmask, kept on the device per row bucket, so they
    never ship them."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._kept: dict[tuple[str, int], Any] = {}  # (what, rows) -> its arrays on the device

    def sampling(self, plan: StepPlan, replicated: NamedSharding) -> Packed:
        """The plan's sampling metadata, for the last stage (its devices: `replicated`)."""
        fields = vars(plan.sampling).copy()  # the plan's SamplingMetadata, in numpy
        rows, vocab = plan.bucket[1], self.vocab_size
        # The large optional arrays are placed on their own, so the packed layout is the same with them or without.
        if fields["output_counts"] is None:
            fields["output_counts"], fields["seen_tokens"] = self._kept_on_device(
                "penalties", rows, lambda: (np.zeros((rows, vocab), np.int32), np.zeros((rows, vocab), bool)), replicated)
        else:
            fields["output_counts"], fields["seen_tokens"] = jax.device_put(
                (fields["output_counts"], fields["seen_tokens"]), replicated)
        if fields["token_bitmask"] is None:
            fields["token_bitmask"] = self._kept_on_device(
                "bitmask", rows, lambda: np.full((rows, bitmask_width(vocab)), -1, np.int32), replicated)
        else:
            fields["token_bitmask"] = jax.device_put(fields["token_bitmask"], replicated)
        return pack(SamplingMetadata(**fields))  # numpy buffers, placed by the head's call (as the layers' inputs)

    @staticmethod
    def speculation(plan: StepPlan) -> Packed | None:
        if plan.speculation is None:
            return None
        # The plan holds the block tables once (for attention); the head's metadata carries them too.
        return pack(dataclasses.replace(plan.speculation, block_tables=plan.block_tables))

    def _kept_on_device(self, what: str, rows: int, make: Callable[[], Any], replicated: NamedSharding):
        """`make()`'s arrays, placed on the devices the first time a row bucket asks, then kept."""
        if (what, rows) not in self._kept:
            self._kept[what, rows] = jax.device_put(make(), replicated)
        return self._kept[what, rows]
