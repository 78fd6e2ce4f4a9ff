"""Building one pipeline stage: a contiguous run of layers on its own mesh of tp devices, with its
parameters placed (K/V heads widened for tp, float matrices turned into rows for the native
kernel), its KV arrays and its two jitted programs (the layers; on the last stage the head).

The programs take the parameters as leaves flattened once (a step does not flatten the State's
~270 variables at every call: ~1.5 ms of host time per step) and the step's host arrays packed
(step_inputs.py). With one stage the head also returns its sampled tokens padded to [R_max]
(`Stage.fed_tokens`), and the next step's layers take a plan's `token_source` tokens from them:
async scheduling plans a step before the tokens it continues are back on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from orca_jax.config import ConfigError
from orca_jax.engine.step_plan import KVLayout
from orca_jax.model.attention import KVCache
from orca_jax.model.decoder import Decoder, DecoderStage, LMHead
from orca_jax.model.linear import linear_methods
from orca_jax.model.sampler import SamplerOutput, SamplingMetadata, sample
from orca_jax.parallel import kv_cache_sharding, param_shardings
from orca_jax.parallel.tensor_parallel import kv_projections_replicated, replicate_kv_heads, sharded_paged_attention
from orca_jax.runner.float_rows import float_rows_methods, float_rows_stage
from orca_jax.runner.speculation import NgramProposer, SpeculativeOutput, verify_and_propose, write_tokens
from orca_jax.runner.step_inputs import StepInputs
from orca_jax.sampling_params import MAX_LOGPROBS


@dataclasses.dataclass
class Stage:
    """One pipeline stage: a contiguous run of layers on its own mesh of tp devices."""

    index: int
    layers: range
    mesh: Mesh
    replicated: NamedSharding  # step inputs and activations: whole on every device of the stage
    first: bool
    last: bool
    local: bool  # this process owns the stage's devices; otherwise the three fields below are empty
    params: Any = None  # nnx.State of the stage's DecoderStage, sharded by the logical-axis rules
    # `params` flattened once: the programs take the leaves, so a step does not flatten the
    # State's ~270 variables at every call (~1.5 ms of host time per step)
    param_leaves: list = dataclasses.field(default_factory=list)
    head_param_leaves: list = dataclasses.field(default_factory=list)  # the last stage's LMHead's, for its head program
    kv_cache: KVCache | None = None  # the stage's KV pages, its layers' in a few arrays
    # A speculating runner's last stage: the token id of every KV slot [P + 1, page] (speculation.py)
    token_pages: Any = None
    # The only stage's latest sampled tokens [R_max] (int32, one per logit row), which the next
    # step's tokens may take (StepPlan.token_source: async scheduling); None with several stages
    fed_tokens: Any = None
    # jitted (params, kv_cache, token_pages, x, inputs, fed_tokens) -> (activations [T, D], or from
    # the last stage those of each logit row's token [R_max, D]; kv_cache; token_pages)
    layers_program: Callable | None = None
    # Each matrix's linear method (model/linear.py), part of every program's cache key: two layouts
    # can hold arrays of one shape (Q5_0 and Q5_K rows are both 22 bytes per 32 weights)
    linear_methods: str = ""
    # the last stage's jitted (head_param_leaves, logit-row activations [R_max, D], sampling [R], speculation,
    # token_pages) -> (SamplerOutput, or SpeculativeOutput when speculating; the sampled tokens
    # padded to [R_max], the next fed_tokens)
    head_program: Callable | None = None
    # ("layers", T) or ("head", R) -> the compiled program, filled by warm-up
    executables: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StageRecipe:
    """What every stage of a runner is built from, besides its own layers and mesh."""

    model: Decoder
    num_stages: int
    kv_shape: tuple[int, int, int, int]  # a layer's [pages + the scratch page, page size, KV heads (widened for tp), head dim]
    kv_dtype: Any
    kv_layout: KVLayout
    attention_impl: str
    matmul_impl: str
    proposer: Any = None  # NgramProposer | DraftModelProposer | None
    weights: Any = None  # CheckpointWeights | DummyWeights | None: the model's own arrays are placed


def build_stage(recipe: StageRecipe, index: int, layers: range, mesh: Mesh) -> Stage:
    """Stage `index` over `layers` on `mesh`: built on the process that owns the mesh's devices; on
    any other an empty `Stage` with `local=False`."""
    first, last = index == 0, index == recipe.num_stages - 1
    replicated = NamedSharding(mesh, PartitionSpec())
    owners = {device.process_index for device in mesh.devices.flat}
    if len(owners) > 1:
        raise ConfigError(f"pipeline stage {index} spans processes {sorted(owners)}: a stage's "
                          f"tensor_parallel_size={mesh.size} devices must be on one process (make tp divide "
                          "each process's device count)")
    if owners != {jax.process_index()}:
        return Stage(index, layers, mesh, replicated, first, last, local=False)
    graphdef, params = _place_params(recipe, layers, mesh, replicated, first=first, last=last)
    kv_sharding = kv_cache_sharding(mesh)
    module = nnx.merge(graphdef, params)
    head_graphdef, head_params = nnx.split(LMHead(module)) if last else (None, None)
    run_layers, run_head = _stage_functions(recipe, graphdef, jax.tree.structure(params), head_graphdef,
                                            jax.tree.structure(head_params), mesh, first=first)
    # Pinning output placements keeps the donated caches' sharding identical across steps, so a
    # step's outputs are always valid inputs of the next.
    token_pages = None
    if last and isinstance(recipe.proposer, NgramProposer):
        token_pages = jax.device_put(jnp.zeros(recipe.kv_shape[:2], jnp.int32), replicated)
    fed_tokens = (jax.device_put(jnp.zeros(recipe.kv_layout.max_logit_rows, jnp.int32), replicated)
                  if first and last else None)
    layers_program = jax.jit(run_layers, donate_argnums=(1, 2),
                             out_shardings=(replicated, kv_sharding, None if token_pages is None else replicated))
    head_program = jax.jit(run_head, out_shardings=replicated) if last else None
    return Stage(index, layers, mesh, replicated, first, last, local=True, params=params,
                 param_leaves=jax.tree.leaves(params), head_param_leaves=jax.tree.leaves(head_params),
                 linear_methods=linear_methods(module),
                 kv_cache=KVCache.zeros(len(layers), recipe.kv_shape, recipe.kv_dtype, kv_sharding),
                 token_pages=token_pages, fed_tokens=fed_tokens,
                 layers_program=layers_program, head_program=head_program)


def _place_params(recipe: StageRecipe, layers: range, mesh: Mesh, replicated: NamedSharding, *, first: bool,
                  last: bool) -> tuple[nnx.GraphDef, nnx.State]:
    """The stage's graph and its parameters on its devices, sharded by the logical-axis rules:
    the model's own arrays or the checkpoint's (`recipe.weights`, loaded straight into their
    shardings), the K/V projections widened to the tp KV heads, and with matmul_impl "native" the
    float matrices as rows (runner/float_rows.py; native matmuls run at tp = 1, where nothing is
    widened)."""
    model = recipe.model
    graphdef, state = nnx.split(DecoderStage(model, layers, first=first, last=last))
    num_kv_heads = recipe.kv_shape[2]
    widen = num_kv_heads != model.config.n_kv_heads
    shardings = param_shardings(state, mesh)
    if recipe.weights is None:
        params = state  # the model's arrays, placed below
    else:
        # K/V projections that are widened to tp heads arrive whole on every device (their
        # original head count does not split over tp), are widened there, then resharded below.
        params = recipe.weights.stage_params(state, kv_projections_replicated(shardings, replicated) if widen
                                             else shardings, layers=layers, tied=model.config.tie_word_embeddings)
    if recipe.matmul_impl == "native" and float_rows_methods(model):
        # Once, on the arrays as they are: the model's own before placing (their rows are made
        # once per array of the given model and shared by every runner over it), a checkpoint's
        # where they were loaded.
        graphdef, params = float_rows_stage(model, layers, first=first, last=last, state=params, sharding=replicated)
        shardings = param_shardings(params, mesh)
    if recipe.weights is None or widen:
        params = jax.device_put(replicate_kv_heads(params, num_kv_heads) if widen else params, shardings)
    return graphdef, params


def _stage_functions(recipe: StageRecipe, graphdef: nnx.GraphDef, param_treedef, head_graphdef: nnx.GraphDef | None,
                     head_treedef, mesh: Mesh, *, first: bool):
    """The stage's layers and head as functions of their flattened parameters (the stage's, the
    LMHead's), to be jitted."""
    attention = sharded_paged_attention(recipe.attention_impl, mesh)
    max_logit_rows, proposer = recipe.kv_layout.max_logit_rows, recipe.proposer

    def run_layers(param_leaves, kv_cache, token_pages, x, packed_inputs, fed_tokens):
        stage = nnx.merge(graphdef, jax.tree.unflatten(param_treedef, param_leaves))
        inputs: StepInputs = packed_inputs.unpack()
        token_ids = inputs.token_ids
        if fed_tokens is not None:
            fed = fed_tokens[jnp.maximum(inputs.token_source, 0)]
            token_ids = jnp.where(inputs.token_source >= 0, fed, token_ids)
        x, kv_cache = stage(token_ids if first else x, inputs.attention, kv_cache, inputs.logits_index, attention)
        if token_pages is not None:
            token_pages = write_tokens(token_pages, token_ids, inputs.attention.slot_mapping)
        return x, kv_cache, token_pages

    def run_head(head_param_leaves, row_tokens, packed_sampling, packed_speculation, token_pages, draft_probs):
        sampling: SamplingMetadata = packed_sampling.unpack()
        num_rows = sampling.temperature.shape[0]  # the row bucket: only its rows get logits
        head = nnx.merge(head_graphdef, jax.tree.unflatten(head_treedef, head_param_leaves))
        logits = head(row_tokens[:num_rows], sampling.num_real_rows)
        sampled = sample(logits, sampling)
        fed = jnp.zeros(max_logit_rows, jnp.int32).at[:num_rows].set(sampled.tokens)
        if packed_speculation is None:
            return sampled, fed
        return verify_and_propose(proposer, token_pages, logits, sampled, sampling, packed_speculation.unpack(),
                                  draft_probs), fed

    return run_layers, run_head


def result_shapes(num_rows: int, kv: KVLayout) -> SamplerOutput | SpeculativeOutput:
    """The shapes of the head's output for `num_rows` logit rows (placeholders between processes)."""
    def shape(*dims, dtype):
        return jax.ShapeDtypeStruct(dims, jnp.dtype(dtype))

    sampled = SamplerOutput(tokens=shape(num_rows, dtype=jnp.int32), logprob=shape(num_rows, dtype=jnp.float32),
                            top_ids=shape(num_rows, MAX_LOGPROBS, dtype=jnp.int32),
                            top_logprobs=shape(num_rows, MAX_LOGPROBS, dtype=jnp.float32))
    if not kv.num_speculative_tokens:
        return sampled
    return SpeculativeOutput(sampled=sampled, accepted=shape(num_rows, dtype=bool),
                             drafts=shape(kv.max_num_seqs, kv.num_speculative_tokens, dtype=jnp.int32),
                             num_drafts=shape(kv.max_num_seqs, dtype=jnp.int32))
