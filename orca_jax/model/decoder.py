"""The decoder: token ids on a ragged axis in, logits out. One class, variant chosen by ModelConfig."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from orca_jax.config import ModelConfig
from orca_jax.model.attention import Attention, AttentionMetadata, KVCache, LayerKV, PagedAttention
from orca_jax.model.paged_attention import paged_attention
from orca_jax.model.rotary import layer_rotary
from orca_jax.model.layers import Embed, GeluMLP, LayerNorm, RMSNorm, SwiGLU
from orca_jax.model.linear import LinearPlan, all_float, within

# Every logical axis name a parameter may carry; the parallelism rules table maps each to a mesh
# axis (or to None, replicated).
LOGICAL_AXES = ("vocab", "embed", "positions", "q_heads", "kv_heads", "head_dim", "mlp", "norm")


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, index: int, dtype: jnp.dtype, rngs: nnx.Rngs,
                 linear: LinearPlan = all_float):
        """`linear`: the method of each of the layer's matrices, by path ("attn.q", "mlp.down")."""
        llama = config.architecture == "llama"
        norm = RMSNorm if llama else LayerNorm
        self.attn_norm = norm(config.d_model, config.norm_eps, dtype)
        self.attn = Attention(
            config.d_model, config.n_heads, config.n_kv_heads, config.head_dim,
            use_bias=not llama, rotary=layer_rotary(config, index), qkv_bias=config.qkv_bias,
            qk_norm_eps=config.norm_eps if config.qk_norm else None, sliding_window=config.layer_window(index),
            soft_cap=config.attn_logit_softcap,
            sm_scale=None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar ** -0.5,
            dtype=dtype, rngs=rngs, linear=within(linear, "attn"),
        )
        self.mlp_norm = norm(config.d_model, config.norm_eps, dtype)
        mlp_linear = within(linear, "mlp")
        self.mlp = SwiGLU(config.d_model, config.d_ff, dtype, rngs, config.mlp_activation, mlp_linear) if llama else \
            GeluMLP(config.d_model, config.d_ff, dtype, rngs, mlp_linear)
        # Gemma 2/3 also norm each sublayer's output before adding it to the residual stream.
        self.post_attn_norm = RMSNorm(config.d_model, config.norm_eps, dtype) if config.post_norms else None
        self.post_mlp_norm = RMSNorm(config.d_model, config.norm_eps, dtype) if config.post_norms else None

    def __call__(
        self, x: Float[Array, "T D"], meta: AttentionMetadata, kv: LayerKV | None = None,
        attention: PagedAttention = paged_attention,
    ) -> tuple[Float[Array, "T D"], LayerKV | None]:
        attn_out, kv = self.attn(self.attn_norm(x), meta, kv, attention)
        if self.post_attn_norm is not None:
            attn_out = self.post_attn_norm(attn_out)
        x = x + attn_out
        mlp_out = self.mlp(self.mlp_norm(x), meta.num_tokens)
        if self.post_mlp_norm is not None:
            mlp_out = self.post_mlp_norm(mlp_out)
        return x + mlp_out, kv


class Decoder(nnx.Module):
    """Pre-norm decoder-only transformer.

    Inputs live on one ragged token axis: all tokens of all sequences in a call, concatenated. Only
    attention looks across tokens, and only within a segment.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, linear: LinearPlan = all_float):
        """`linear`: the method of each matrix, by its path ("embed", "lm_head", "layers.3.attn.q"):
        float everywhere unless told otherwise (quantization.py, runner/float_rows.py)."""
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.embed = Embed(config.vocab_size, config.d_model, ("vocab", "embed"), dtype, rngs, linear("embed"))
        self.pos_embed = (
            Embed(config.max_position, config.d_model, ("positions", "embed"), dtype, rngs, linear("pos_embed"))
            if config.architecture == "gpt2"
            else None
        )
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs, within(linear, f"layers.{i}"))
                                for i in range(config.n_layers)])
        norm = RMSNorm if config.architecture == "llama" else LayerNorm
        self.final_norm = norm(config.d_model, config.norm_eps, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Embed(config.vocab_size, config.d_model, ("vocab", "embed"), dtype, rngs, linear("lm_head"))
        )

    def __call__(
        self,
        token_ids: Int[Array, " T"],
        positions: Int[Array, " T"],
        segment_ids: Int[Array, " T"],
        logits_index: Int[Array, " S"] | None = None,
    ) -> Float[Array, "T V"] | Float[Array, "S V"]:
        """Returns float32 logits at every token, or only at the tokens named by `logits_index`
        (the last token of each sequence when generating, which skips most of the LM head)."""
        meta = AttentionMetadata(positions=positions, segment_ids=segment_ids)
        logits, _ = self.forward(token_ids, meta, None, logits_index)
        return logits

    def forward(
        self,
        token_ids: Int[Array, " T"],
        meta: AttentionMetadata,
        kv_cache: KVCache | None,
        logits_index: Int[Array, " S"] | None = None,
        attention: PagedAttention = paged_attention,
    ) -> tuple[Float[Array, "T V"] | Float[Array, "S V"], KVCache | None]:
        """The whole model in one call: with `kv_cache` (every layer's pages) the new tokens' K/V
        are written and attention reads the cache; returns the updated cache. The
        engine runs the same computation as `DecoderStage`s (one, or one per pipeline stage)."""
        x = embed_tokens(self.embed, self.pos_embed, token_ids, meta.positions, self.config)
        x, kv_cache = run_layers(self.layers, x, meta, kv_cache, attention)
        head = self.embed if self.lm_head is None else self.lm_head
        return project_logits(self.final_norm, head, x, logits_index, self.config.final_logit_softcap), kv_cache


class DecoderStage(nnx.Module):
    """A contiguous run of a decoder's layers: one pipeline stage's parameters and computation.

    The first stage also embeds the token ids; the last also applies the final norm and the LM head
    (with tied embeddings it holds the embedding matrix for that). It refers to the decoder's own
    submodules (nothing is copied), so `nnx.split(stage)` gives exactly the parameters the stage's
    devices must hold. With one stage it is the whole decoder.
    """

    def __init__(self, decoder: Decoder, layers: range, *, first: bool, last: bool):
        self.first, self.last = first, last
        self.config = decoder.config
        self.embed = decoder.embed if first else None
        self.pos_embed = decoder.pos_embed if first else None
        self.layers = nnx.List([decoder.layers[i] for i in layers])
        self.final_norm = decoder.final_norm if last else None
        self.head = (decoder.embed if decoder.lm_head is None else decoder.lm_head) if last else None

    def __call__(
        self,
        inputs: Int[Array, " T"] | Float[Array, "T D"],
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits_index: Int[Array, " S"],
        attention: PagedAttention,
    ) -> tuple[Float[Array, "T D"] | Float[Array, "S V"], KVCache]:
        """`inputs`: token ids for the first stage, the previous stage's activations otherwise.
        Returns activations [T, D] for the next stage, or, from the last stage, the activations of
        the tokens named by `logits_index` [S, D], for `logits`."""
        x = embed_tokens(self.embed, self.pos_embed, inputs, meta.positions, self.config) if self.first else inputs
        x, kv_cache = run_layers(self.layers, x, meta, kv_cache, attention)
        return (x[logits_index] if self.last else x), kv_cache

    def logits(self, x: Float[Array, "S D"], num_rows: Int[Array, ""] | None = None) -> Float[Array, "S V"]:
        """The last stage's final norm and LM head, apart from the layers: `LMHead`'s logits."""
        return LMHead(self)(x, num_rows)


class LMHead(nnx.Module):
    """The last stage's final norm and LM head alone, referring to the stage's own submodules
    (nothing is copied). The runner compiles them per sequence bucket and the layers per token
    bucket only, and the head's program takes only these parameters: a compiled call checks every
    argument it is given, and handed all of SmolLM2's 272 arrays the head's call took 0.19 ms of
    host time per decode step, given its 2 it takes 0.09 ms (AMD EPYC Zen 4)."""

    def __init__(self, stage: DecoderStage):
        self.final_norm, self.head = stage.final_norm, stage.head
        self.soft_cap = stage.config.final_logit_softcap

    def __call__(self, x: Float[Array, "S D"], num_rows: Int[Array, ""] | None = None) -> Float[Array, "S V"]:
        """Logits of the rows of x; rows from `num_rows` on are the bucket's padding (the native
        matmul leaves them zero)."""
        return project_logits(self.final_norm, self.head, x, None, self.soft_cap, num_rows)


def embed_tokens(embed: Embed, pos_embed: Embed | None, token_ids: Int[Array, " T"],
                 positions: Int[Array, " T"], config: ModelConfig) -> Float[Array, "T D"]:
    x = embed(token_ids)
    if config.embed_scale:  # Gemma; the factor rounded to the activations' dtype, as Gemma does
        x = x * jnp.asarray(config.d_model ** 0.5, x.dtype)
    return x if pos_embed is None else x + pos_embed(positions)


def run_layers(layers, x: Float[Array, "T D"], meta: AttentionMetadata, kv_cache: KVCache | None,
               attention: PagedAttention) -> tuple[Float[Array, "T D"], KVCache | None]:
    """The layers in order; with a cache, each layer's attention writes and reads its own pages of it."""
    if kv_cache is None:
        for layer in layers:
            x, _ = layer(x, meta, None, attention)
        return x, None
    if kv_cache.num_layers != len(layers):
        raise ValueError(f"a KV cache of {kv_cache.num_layers} layers given to {len(layers)} layers")
    k, v = list(kv_cache.k), list(kv_cache.v)
    for i, layer in enumerate(layers):
        index, pages = kv_cache.where(i)
        x, (k[index], v[index]) = layer(x, meta, (k[index], v[index]), functools.partial(attention, pages=pages))
    return x, dataclasses.replace(kv_cache, k=tuple(k), v=tuple(v))


def project_logits(final_norm, head: Embed, x: Float[Array, "T D"], logits_index: Int[Array, " S"] | None,
                   soft_cap: float | None = None,
                   num_rows: Int[Array, ""] | None = None) -> Float[Array, "T V"] | Float[Array, "S V"]:
    """Float32 logits at every token, or only at `logits_index` (each sequence's last token when
    generating, which skips most of the LM head); soft-capped (cap * tanh(l / cap)) if asked (Gemma 2)."""
    if logits_index is not None:
        x = x[logits_index]  # [S, D]
    logits = head.attend(final_norm(x), num_rows).astype(jnp.float32)
    return logits if soft_cap is None else soft_cap * jnp.tanh(logits / soft_cap)


def init_decoder(config: ModelConfig, seed: int = 0, linear: LinearPlan = all_float) -> Decoder:
    """A randomly initialised decoder (tests, benchmarks of shapes without weights)."""
    return Decoder(config, rngs=nnx.Rngs(params=jax.random.key(seed)), linear=linear)


def abstract_decoder(config: ModelConfig, linear: LinearPlan = all_float) -> Decoder:
    """The decoder's structure with ShapeDtypeStructs instead of arrays: allocates nothing, so a
    checkpoint can be restored straight into it and a 175B config can be planned on a laptop."""
    return nnx.eval_shape(lambda: init_decoder(config, linear=linear))
