"""The model runner: the only owner of jit, buckets, devices, the mesh, parameters and KV arrays.

Each step turns a SchedulerOutput into padded numpy arrays (DESIGN.md, "One iteration"), runs the
jitted step for its (tokens, sequences) bucket and copies back one small result. Every bucket is
compiled at warm-up; `num_compilations_after_warmup` counts any compilation after that (it must
stay 0: a recompile in serving is a multi-second stall).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Int
from tqdm.auto import tqdm

from orca_jax.config import REPO_ROOT, ParallelConfig
from orca_jax.engine.request import Request
from orca_jax.engine.scheduler import SchedulerOutput
from orca_jax.model.attention import AttentionMetadata
from orca_jax.model.decoder import Decoder
from orca_jax.model.sampler import SamplerOutput, SamplingMetadata, sample
from orca_jax.parallel import kv_cache_sharding, make_mesh, param_shardings
from orca_jax.sampling_params import MAX_STOP_IDS
MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 4


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache, on by default: a second start-up skips XLA compiles.
    $ORCA_JAX_COMPILATION_CACHE overrides the location; an explicit jax config setting wins."""
    if jax.config.jax_compilation_cache_dir:
        return
    path = os.environ.get("ORCA_JAX_COMPILATION_CACHE", str(REPO_ROOT / ".jax_cache"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def power_of_two_buckets(low: int, high: int) -> tuple[int, ...]:
    """low, 2*low, ... below high, then high itself: never a bucket above the limit."""
    buckets, size = [], low
    while size < high:
        buckets.append(size)
        size *= 2
    return tuple(buckets) + (high,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]
    seqs: tuple[int, ...]

    @classmethod
    def for_limits(cls, max_num_batched_tokens: int, max_num_seqs: int) -> "Buckets":
        """Powers of two up to the limits. The smallest buckets are coarse on purpose: each bucket
        costs a compile (~7 s for SmolLM2 on 2 cores), and padding a tiny step is cheap."""
        return cls(
            tokens=power_of_two_buckets(min(MIN_TOKEN_BUCKET, max_num_batched_tokens), max_num_batched_tokens),
            seqs=power_of_two_buckets(min(MIN_SEQ_BUCKET, max_num_seqs), max_num_seqs),
        )

    def pairs(self) -> list[tuple[int, int]]:
        """Every (tokens, seqs) shape a step can take: a sequence has at least one token."""
        return [(t, s) for t in self.tokens for s in self.seqs if s <= t]

    def pick(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        t = next((b for b in self.tokens if b >= num_tokens), None)
        s = next((b for b in self.seqs if b >= num_seqs), None)
        if t is None or s is None:
            raise ValueError(f"step of {num_tokens} tokens / {num_seqs} seqs exceeds the buckets {self}")
        return t, s


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    token_ids: Int[Array, " T"]
    positions: Int[Array, " T"]
    segment_ids: Int[Array, " T"]  # row of the token's sequence; padding: S (out of range)
    slot_mapping: Int[Array, " T"]  # padding: the scratch slot
    block_tables: Int[Array, "S max_pages"]
    kv_lens: Int[Array, " S"]
    logits_index: Int[Array, " S"]  # last token of each sequence


@dataclasses.dataclass
class RunnerStats:
    """Cumulative figures since start (or the last `reset`), for benchmarks and metrics."""

    steps: int = 0
    prepare_s: float = 0.0  # host: building the padded arrays
    device_s: float = 0.0  # dispatch + device compute + the result copy
    real_tokens: int = 0
    padded_tokens: int = 0  # tokens computed including bucket padding


@dataclasses.dataclass
class SampledToken:
    token: int
    logprob: float
    top: tuple[list[int], list[float]] | None  # top-N ids and logprobs, when the request asked


class ModelRunner:
    def __init__(
        self,
        model: Decoder,
        *,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        buckets: Buckets,
        attention_impl: str,
        parallel: ParallelConfig,
    ):
        enable_compilation_cache()
        config = model.config
        self.config = config
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.buckets = buckets
        self.attention_impl = attention_impl
        self.scratch_slot = num_pages * page_size  # the extra page at index num_pages: padding writes
        self.mesh = make_mesh(parallel)

        graphdef, state = nnx.split(model)
        self.params = jax.device_put(state, param_shardings(state, self.mesh))
        kv_shape = (num_pages + 1, page_size, config.n_kv_heads, config.head_dim)
        kv_sharding = kv_cache_sharding(self.mesh)
        dtype = jnp.dtype(config.dtype)
        zeros = jax.jit(lambda: jnp.zeros(kv_shape, dtype), out_shardings=kv_sharding)
        self.kv_caches = [(zeros(), zeros()) for _ in range(config.n_layers)]
        self._zero_penalties: dict[int, tuple[jax.Array, jax.Array]] = {}

        def step(params, kv_caches, inputs: StepInputs, sampling: SamplingMetadata):
            model = nnx.merge(graphdef, params)
            meta = AttentionMetadata(
                positions=inputs.positions,
                segment_ids=inputs.segment_ids,
                slot_mapping=inputs.slot_mapping,
                block_tables=inputs.block_tables,
                kv_lens=inputs.kv_lens,
                attention_impl=attention_impl,
            )
            logits, kv_caches = model.forward(inputs.token_ids, meta, kv_caches, inputs.logits_index)
            return sample(logits, sampling), kv_caches

        # Pinning output placements keeps the donated caches' sharding identical across steps, so
        # the jit cache key never changes after warm-up.
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self._step = jax.jit(step, donate_argnums=(1,), out_shardings=(self.replicated, kv_sharding))
        self._warm_cache_size: int | None = None
        self.stats = RunnerStats()

    # ---- compilation ---------------------------------------------------------------------
    def warm_up(self, show_progress: bool = True) -> float:
        """Compiles (or loads from the persistent cache) every bucket; returns seconds taken."""
        start = time.perf_counter()
        pairs = self.buckets.pairs()
        for tokens, seqs in tqdm(pairs, desc="compiling buckets", disable=not show_progress, leave=False):
            self._run(self._padding_inputs(tokens, seqs), self._sampling_metadata([], seqs))
        elapsed = time.perf_counter() - start
        self._warm_cache_size = self._step._cache_size()
        self.stats = RunnerStats()
        if show_progress:
            print(f"warm-up: {len(pairs)} buckets (tokens {list(self.buckets.tokens)} x seqs "
                  f"{list(self.buckets.seqs)}) ready in {elapsed:.1f} s", file=sys.stderr)
        return elapsed

    @property
    def num_compilations_after_warmup(self) -> int:
        if self._warm_cache_size is None:
            return 0
        return self._step._cache_size() - self._warm_cache_size

    # ---- one step ------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Runs one step; returns the sampled token of every request whose step reached its end."""
        start = time.perf_counter()
        inputs, sampling = self._prepare(out)
        self.stats.prepare_s += time.perf_counter() - start
        self.stats.steps += 1
        self.stats.padded_tokens += len(inputs.token_ids)
        self.stats.real_tokens += out.num_batched_tokens
        result = self._run(inputs, sampling)
        sampled = {}
        for row, planned in enumerate(out.scheduled):
            if not planned.samples:
                continue
            request = planned.request
            top = None
            if request.params.logprobs is not None:
                n = request.params.logprobs
                top = (result.top_ids[row, :n].tolist(), result.top_logprobs[row, :n].tolist())
            sampled[request.request_id] = SampledToken(
                token=int(result.tokens[row]), logprob=float(result.logprob[row]), top=top
            )
        return sampled

    def _run(self, inputs: StepInputs, sampling: SamplingMetadata) -> SamplerOutput:
        start = time.perf_counter()
        # One explicit placement for host arrays and device-resident ones alike: mixing the two
        # would give the jit cache two keys for one bucket.
        inputs, sampling = jax.device_put((inputs, sampling), self.replicated)
        result, self.kv_caches = self._step(self.params, self.kv_caches, inputs, sampling)
        result = jax.device_get(result)  # the step's one device -> host copy
        self.stats.device_s += time.perf_counter() - start
        return result

    def _prepare(self, out: SchedulerOutput) -> tuple[StepInputs, SamplingMetadata]:
        # Static batches keep finished members as padding rows: they cost compute, as in FasterTransformer.
        num_tokens, num_seqs = self.buckets.pick(out.num_batched_tokens + out.num_padding_seqs, out.num_seqs)
        inputs = self._padding_inputs(num_tokens, num_seqs)
        t = 0
        for row, planned in enumerate(out.scheduled):
            request, n, start = planned.request, planned.num_new_tokens, planned.start
            pos = np.arange(start, start + n, dtype=np.int32)
            table = np.asarray(request.block_table, np.int32)
            inputs.token_ids[t:t + n] = request.token_ids_between(start, start + n)
            inputs.positions[t:t + n] = pos
            inputs.segment_ids[t:t + n] = row
            inputs.slot_mapping[t:t + n] = table[pos // self.page_size] * self.page_size + pos % self.page_size
            inputs.block_tables[row, :len(table)] = table
            inputs.kv_lens[row] = start + n
            inputs.logits_index[row] = t + n - 1
            t += n
        return inputs, self._sampling_metadata([p.request for p in out.scheduled], num_seqs)

    def _sampling_metadata(self, requests: list[Request], num_seqs: int) -> SamplingMetadata:
        def column(get, dtype, fill):
            values = np.full(num_seqs, fill, dtype)
            values[:len(requests)] = [get(r) for r in requests]
            return values

        stop_ids = np.full((num_seqs, MAX_STOP_IDS), -1, np.int32)
        suppress = np.zeros(num_seqs, bool)
        for row, r in enumerate(requests):
            if len(r.output_token_ids) < r.params.min_tokens:
                ids = list(r.params.stop_token_ids)
                if not r.params.ignore_eos and r.eos_token_id is not None:
                    ids.append(r.eos_token_id)
                stop_ids[row, :len(ids)] = ids
                suppress[row] = True
        use_penalties = any(r.params.uses_penalties for r in requests)
        if use_penalties:
            vocab = self.config.vocab_size
            counts = np.zeros((num_seqs, vocab), np.int32)
            seen = np.zeros((num_seqs, vocab), bool)
            for row, r in enumerate(requests):
                if r.params.uses_penalties:
                    counts[row] = np.bincount(r.output_token_ids, minlength=vocab)
                    seen[row, r.prompt_token_ids] = True
                    seen[row] |= counts[row] > 0
        else:
            counts, seen = self._zero_penalty_arrays(num_seqs)
        return SamplingMetadata(
            temperature=column(lambda r: r.params.temperature, np.float32, 0.0),
            top_k=column(lambda r: r.params.top_k, np.int32, 0),
            top_p=column(lambda r: r.params.top_p, np.float32, 1.0),
            min_p=column(lambda r: r.params.min_p, np.float32, 0.0),
            repetition_penalty=column(lambda r: r.params.repetition_penalty, np.float32, 1.0),
            presence_penalty=column(lambda r: r.params.presence_penalty, np.float32, 0.0),
            frequency_penalty=column(lambda r: r.params.frequency_penalty, np.float32, 0.0),
            seeds=column(lambda r: (r.seed ^ (r.seed >> 32)) & 0xFFFFFFFF, np.uint32, 0),
            token_index=column(lambda r: len(r.output_token_ids), np.int32, 0),
            stop_ids=stop_ids,
            suppress_stop=suppress,
            output_counts=counts,
            seen_tokens=seen,
            use_penalties=np.bool_(use_penalties),
            need_logprobs=np.bool_(any(r.params.logprobs is not None for r in requests)),
        )

    def _zero_penalty_arrays(self, num_seqs: int) -> tuple[jax.Array, jax.Array]:
        """Kept on device per bucket, so steps without penalties never ship [S, V] arrays."""
        if num_seqs not in self._zero_penalties:
            vocab = self.config.vocab_size
            self._zero_penalties[num_seqs] = jax.device_put(
                (np.zeros((num_seqs, vocab), np.int32), np.zeros((num_seqs, vocab), bool)), self.replicated
            )
        return self._zero_penalties[num_seqs]

    def _padding_inputs(self, num_tokens: int, num_seqs: int) -> StepInputs:
        """Host arrays of one bucket's shape, all padding (tokens out of every segment, writing only
        to the scratch slot). Warm-up runs them as they are; `_prepare` fills in the real rows."""
        return StepInputs(
            token_ids=np.zeros(num_tokens, np.int32),
            positions=np.zeros(num_tokens, np.int32),
            segment_ids=np.full(num_tokens, num_seqs, np.int32),
            slot_mapping=np.full(num_tokens, self.scratch_slot, np.int32),
            block_tables=np.zeros((num_seqs, self.max_pages_per_seq), np.int32),
            kv_lens=np.zeros(num_seqs, np.int32),
            logits_index=np.zeros(num_seqs, np.int32),
        )
