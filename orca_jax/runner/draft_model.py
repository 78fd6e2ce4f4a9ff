"""Speculative decoding's draft model: a smaller model with the target's tokenizer proposes each
request's next drafts on the device, as its own compiled programs with its own KV pages.

Pages. The draft's KV arrays have the target's page count and page size and are addressed by the
very same block tables and slot mappings: a request's pages hold the target's K/V in the target's
arrays and the draft's K/V in the draft's. The engine's one page manager thus manages both, and
allocation, preemption, abort, the prefix cache and the shrink of rejected drafts free everything
(a prefix-cached page carries the draft's K/V of its tokens too: both were written in one step).

A step, all on the target's last pipeline stage (its mesh), after the target's layers:

1. Catch-up (`catch_up{T}`, per token bucket). The draft runs on the step's own tokens (prompt
   chunks, decode tokens, drafts) at the step's slots, so its cache holds every token the target's
   does; rejected drafts are overwritten later in both. It keeps the activations of the step's
   logit rows.
2. q (`q{R}`, per logit-row bucket, only when a row at temperature > 0 checks a draft): the draft's
   distribution at every logit row, which is the q each draft was drawn from (the same tokens at
   the same positions; equal up to the float rounding of a differently shaped batch).
3. The target's head samples and verifies (speculation.py: exact match for greedy rows, rejection
   sampling against q otherwise).
4. Proposal (`propose{R}x{S}`, per logit-row and sequence bucket, skipped when no sequence
   proposes; S, not R, sets its cost: one sequence with k drafts has 1 + k rows, and S covers the
   sequence rows up to the last that proposes): from the
   target's new token, k one-token decode steps of the draft for every proposing sequence, each
   writing its K/V at the next position and drawing the next draft (argmax for greedy requests, a
   draw from q = softmax(logits / temperature) keyed by seed and token index otherwise). These
   K/V are scratch: the next step's catch-up writes the same positions again. The scheduler
   allocates the slots ahead (DraftPolicy.lookahead); a draft whose K/V would fall outside the
   request's pages (seq_num_slots) is not proposed.

Like the target's, every program is compiled (or loaded from the executable store) at warm-up:
|token buckets| + |row buckets| + the (R, S) pairs with S <= R (`propose_shapes`), and one missing
after warm-up is counted.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from orca_jax.config import ConfigError, ParallelConfig
from orca_jax.engine.step_plan import Buckets, KVLayout, StepPlan, padding_plan
from orca_jax.model.attention import AttentionMetadata, KVCache
from orca_jax.model.decoder import DecoderStage
from orca_jax.model.sampler import SamplingMetadata, first_argmax
from orca_jax.parallel import kv_cache_sharding, param_shardings
from orca_jax.parallel.layout import check_parallel, kv_heads_for_tp
from orca_jax.parallel.tensor_parallel import replicate_kv_heads, sharded_paged_attention
from orca_jax.runner.programs import Programs
from orca_jax.runner.stage import Stage
from orca_jax.runner.step_inputs import HeadInputs, LayersInputs
from orca_jax.runner.speculation import (DRAFT_SALT, DraftModelProposer, SpeculationMetadata, SpeculativeOutput,
                                         draft_scaled_logits, salted_keys)

log = logging.getLogger(__name__)


class DraftModelRunner:
    def __init__(self, proposer: DraftModelProposer, mesh, replicated: NamedSharding, kv_layout: KVLayout,
                 buckets: Buckets, attention_impl: str, kv_dtype, tensor_parallel_size: int,
                 compile_program: Callable, example_inputs: Callable[[str, int], tuple]):
        """Places the draft model on the target's last stage (`mesh`, tp devices). `compile_program(name,
        args, depends_on, program)` compiles or loads one program (the target runner's executable
        store and matmul precision). `example_inputs("layers", T)` is (a padding plan's token arrays as
        the target's layers take them,); `example_inputs("head", R)` the head's (sampling,
        speculation) metadata for R logit rows."""
        model, config = proposer.model, proposer.config
        try:
            check_parallel(config, ParallelConfig(tensor_parallel_size=tensor_parallel_size))
        except ConfigError as error:
            raise ConfigError(f"speculative_config.model={proposer.name!r} cannot run on the target's "
                              f"tensor_parallel_size={tensor_parallel_size}: {error}") from None
        self.proposer = proposer
        self.config = config
        self.k = proposer.num_speculative_tokens
        self.kv_layout = kv_layout
        self.buckets = buckets
        self.replicated = replicated
        self._compile_program = compile_program
        self._example_inputs = example_inputs
        graphdef, state = nnx.split(DecoderStage(model, range(config.n_layers), first=True, last=True))
        num_kv_heads = kv_heads_for_tp(config, tensor_parallel_size)
        if num_kv_heads != config.n_kv_heads:
            state = replicate_kv_heads(state, num_kv_heads)
        self.params = jax.device_put(state, param_shardings(state, mesh))
        kv_shape = (kv_layout.num_pages + 1, kv_layout.page_size, num_kv_heads, config.head_dim)  # a layer's
        self.kv_cache = KVCache.zeros(config.n_layers, kv_shape, kv_dtype, kv_cache_sharding(mesh))
        attention = sharded_paged_attention(attention_impl, mesh)
        self.executables: dict[tuple[str, Any], Any] = {}
        self._seq_rows: dict[int, jax.Array] = {}  # the propose programs' [S] sequence rows, per S
        self.warmed_up = False
        self.num_compilations_after_warmup = 0

        def catch_up(params, kv_cache, inputs):
            stage = nnx.merge(graphdef, params)
            return stage(inputs.token_ids, inputs.attention, kv_cache, inputs.logits_index, attention)

        def q(params, row_x, temperature, row_draft):
            num_rows = temperature.shape[0]

            def probs(row_x):
                logits = nnx.merge(graphdef, params).logits(row_x[:num_rows])
                return jax.nn.softmax(draft_scaled_logits(logits, temperature), axis=-1)

            needed = ((temperature > 0) & (row_draft >= 0)).any()
            return jax.lax.cond(needed, probs, lambda _: jnp.zeros((num_rows, config.vocab_size), jnp.float32),
                                row_x)

        def propose(params, kv_cache, seqs, tokens, accepted, sampling: SamplingMetadata, m: SpeculationMetadata):
            return self._propose(nnx.merge(graphdef, params), attention, kv_cache, seqs, tokens, accepted, sampling, m)

        kv_sharding = kv_cache_sharding(mesh)
        self.programs = {
            "catch_up": jax.jit(catch_up, donate_argnums=(1,), out_shardings=(replicated, kv_sharding)),
            "q": jax.jit(q, out_shardings=replicated),
            "propose": jax.jit(propose, donate_argnums=(1,), out_shardings=(replicated, replicated, kv_sharding)),
        }

    def describe(self) -> str:
        return f"draft model {self.config.name} ({self.proposer.name}), drafts of up to {self.k}"

    # ---- compilation ---------------------------------------------------------------------
    def compile_programs(self) -> None:
        for t in self.buckets.tokens:
            self.executables["catch_up", t] = self._compile("catch_up", t)
        for r in self.buckets.row_buckets:
            self.executables["q", r] = self._compile("q", r)
        for shape in self.propose_shapes():
            self.executables["propose", shape] = self._compile("propose", shape)
        self.warmed_up = True

    def propose_shapes(self) -> list[tuple[int, int]]:
        """Every (row bucket R, sequence bucket S) of a step: its proposing sequences are among its
        rows, so S <= R (rows of sequences that do not propose, such as prompt chunks, pad R only)."""
        return [(r, s) for r in self.buckets.row_buckets for s in self.buckets.seqs if s <= r]

    def seq_rows(self, num_seqs: int) -> jax.Array:
        if num_seqs not in self._seq_rows:
            self._seq_rows[num_seqs] = jax.device_put(jnp.arange(num_seqs, dtype=jnp.int32), self.replicated)
        return self._seq_rows[num_seqs]

    def _compile(self, name: str, size):
        if name == "catch_up":
            (inputs,) = self._example_inputs("layers", size)
            placed = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.replicated)  # noqa: E731
            args = (self.params, self.kv_cache, jax.tree.map(placed, inputs))
        else:
            rows, seqs = size if name == "propose" else (size, None)
            sampling, speculation = self._example_inputs("head", rows)
            if name == "q":
                row_x = jax.ShapeDtypeStruct((self.kv_layout.max_logit_rows, self.config.d_model),
                                             jnp.dtype(self.config.dtype), sharding=self.replicated)
                args = (self.params, row_x, sampling.temperature, speculation.row_draft)
            else:
                row = lambda dtype: jax.ShapeDtypeStruct((rows,), dtype, sharding=self.replicated)  # noqa: E731
                args = (self.params, self.kv_cache, self.seq_rows(seqs), row(jnp.int32), row(jnp.bool_), sampling,
                        speculation)
        depends_on = repr((self.config, self.k, self.kv_layout))
        label = "x".join(map(str, size)) if name == "propose" else size
        return self._compile_program(f"draft-{name}{label}", args, depends_on, self.programs[name])

    def _program(self, name: str, size):
        compiled = self.executables.get((name, size))
        if compiled is None:
            if self.warmed_up:
                self.num_compilations_after_warmup += 1
                log.warning("compiling the draft model's %s program of shape %s after warm-up: a stall", name, size)
            compiled = self.executables[name, size] = self._compile(name, size)
        return compiled

    # ---- one step ------------------------------------------------------------------------
    def catch_up(self, plan: StepPlan, inputs, sampling: SamplingMetadata, speculation: SpeculationMetadata):
        """Step 1 and 2: the draft's K/V of the step's tokens; returns q [R, V] for the head."""
        num_tokens, num_rows = plan.bucket
        row_x, self.kv_cache = self._program("catch_up", num_tokens)(self.params, self.kv_cache, inputs)
        return self._program("q", num_rows)(self.params, row_x, sampling.temperature, speculation.row_draft)

    def propose(self, plan: StepPlan, result: SpeculativeOutput, sampling: SamplingMetadata,
                speculation: SpeculationMetadata) -> SpeculativeOutput:
        """Step 4: the next drafts of every proposing sequence, into the head's result."""
        if not plan.speculation.any_proposes:
            return result
        last_proposing = int(np.flatnonzero(plan.speculation.seq_proposes)[-1])
        num_seqs = next(s for s in self.buckets.seqs if s > last_proposing)  # sequence rows 0..S-1
        drafts, num_drafts, self.kv_cache = self._program("propose", (plan.bucket[1], num_seqs))(
            self.params, self.kv_cache, self.seq_rows(num_seqs), result.sampled.tokens, result.accepted, sampling,
            speculation)
        return SpeculativeOutput(sampled=result.sampled, accepted=result.accepted, drafts=drafts,
                                 num_drafts=num_drafts)

    def _propose(self, stage: DecoderStage, attention, kv_cache, seqs, tokens, accepted, sampling: SamplingMetadata,
                 m: SpeculationMetadata):
        """`seqs` [S]: the sequence rows 0..S-1 (the step's sequences, padded to their bucket)."""
        kv, k = self.kv_layout, self.k
        max_seqs, max_pages = m.block_tables.shape
        num_seqs = seqs.shape[0]
        num_accepted = jax.ops.segment_sum(accepted.astype(jnp.int32), m.row_seq, num_segments=max_seqs)[:num_seqs]
        new_row = jnp.minimum(m.seq_first_row[:num_seqs] + num_accepted, tokens.shape[0] - 1)  # drew the new token
        start = m.seq_history_len[:num_seqs] + num_accepted  # the new token's position
        temperature, seeds = sampling.temperature[new_row], sampling.seeds[new_row]
        first_index = sampling.token_index[new_row] + 1  # the output index of the first draft
        # Draft j (from 0) is drawn by loop step j, whose input's K/V go to position start + j.
        room = jnp.where(m.seq_proposes[:num_seqs], jnp.clip(m.seq_num_slots[:num_seqs] - start, 0, k), 0)

        def draft_step(j, carry):
            kv_cache, token, drafts = carry
            position = start + j
            writes = j < room
            page = jnp.clip(position // kv.page_size, 0, max_pages - 1)
            slot = m.block_tables[seqs, page] * kv.page_size + position % kv.page_size
            meta = AttentionMetadata(
                positions=position, segment_ids=jnp.where(writes, seqs, max_seqs),
                slot_mapping=jnp.where(writes, slot, kv.scratch_slot), block_tables=m.block_tables,
                kv_lens=jnp.zeros(max_seqs, jnp.int32).at[:num_seqs].set(jnp.where(writes, position + 1, 0)))
            x, kv_cache = stage(token, meta, kv_cache, seqs, attention)
            logits = stage.logits(x)  # [S, V]

            def draw(logits):
                keys = salted_keys(seeds, first_index + j, DRAFT_SALT)
                gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
                return first_argmax(draft_scaled_logits(logits, temperature) + gumbel)

            greedy = first_argmax(logits)
            drawn = jax.lax.cond((temperature > 0).any(), draw, lambda _: greedy, logits)
            token = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
            return kv_cache, token, drafts.at[:, j].set(token)

        x0 = tokens[new_row]
        kv_cache, _, drafts = jax.lax.fori_loop(0, k, draft_step,
                                                (kv_cache, x0, jnp.full((num_seqs, k), -1, jnp.int32)))
        drafts = jnp.where(jnp.arange(k)[None, :] < room[:, None], drafts, -1)
        all_drafts = jnp.full((max_seqs, k), -1, jnp.int32).at[:num_seqs].set(drafts)
        num_drafts = jnp.zeros(max_seqs, jnp.int32).at[:num_seqs].set(room)
        return all_drafts, num_drafts, kv_cache



def build_drafter(proposer: DraftModelProposer, last: Stage, kv_layout: KVLayout, buckets: Buckets, vocab_size: int,
                  attention_impl: str, kv_dtype, tensor_parallel_size: int, programs: Programs,
                  layers_inputs: LayersInputs, head_inputs: HeadInputs) -> DraftModelRunner:
    """The draft model wired to the target runner: on its last stage's devices, its programs
    compiled through the target's (`programs`: the same executable store and matmul precision) for
    the target's padding steps (`vocab_size`: the target's)."""

    def example_inputs(kind: str, size: int):
        if kind == "layers":
            return (layers_inputs(padding_plan(size, buckets.row_buckets[0], kv_layout, vocab_size)).unpack(),)
        plan = padding_plan(buckets.tokens[0], size, kv_layout, vocab_size)
        metadata = head_inputs.sampling(plan, last.replicated), head_inputs.speculation(plan)
        return tuple(packed.unpack() for packed in jax.device_put(metadata, last.replicated))

    def compile_program(name, args, depends_on, program):
        return programs.compile_draft(name, args, depends_on, program, list(last.mesh.devices.flat))

    return DraftModelRunner(proposer, last.mesh, last.replicated, kv_layout, buckets, attention_impl, kv_dtype,
                            tensor_parallel_size, compile_program, example_inputs)
