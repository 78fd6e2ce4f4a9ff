"""The decoder: token ids on a ragged axis in, logits out. One class, variant chosen by ModelConfig."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from orca_jax.config import ModelConfig
from orca_jax.model.attention import Attention, AttentionMetadata, KVCache, PagedAttention
from orca_jax.model.paged_attention import paged_attention
from orca_jax.model.rotary import rope_scaling_of
from orca_jax.model.layers import Embed, GeluMLP, LayerNorm, RMSNorm, SwiGLU

# Every logical axis name a parameter may carry; the parallelism rules table maps each to a mesh
# axis (or to None, replicated).
LOGICAL_AXES = ("vocab", "embed", "positions", "q_heads", "kv_heads", "head_dim", "mlp", "norm")


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        llama = config.architecture == "llama"
        norm = RMSNorm if llama else LayerNorm
        self.attn_norm = norm(config.d_model, config.norm_eps, dtype)
        self.attn = Attention(
            config.d_model, config.n_heads, config.n_kv_heads, config.head_dim,
            use_bias=not llama, rope_theta=config.rope_theta if llama else None,
            rope_scaling=rope_scaling_of(config), qkv_bias=config.qkv_bias,
            qk_norm_eps=config.norm_eps if config.qk_norm else None, dtype=dtype, rngs=rngs,
        )
        self.mlp_norm = norm(config.d_model, config.norm_eps, dtype)
        mlp = SwiGLU if llama else GeluMLP
        self.mlp = mlp(config.d_model, config.d_ff, dtype, rngs)

    def __call__(
        self, x: Float[Array, "T D"], meta: AttentionMetadata, kv: KVCache | None = None,
        attention: PagedAttention = paged_attention,
    ) -> tuple[Float[Array, "T D"], KVCache | None]:
        attn_out, kv = self.attn(self.attn_norm(x), meta, kv, attention)
        x = x + attn_out
        return x + self.mlp(self.mlp_norm(x)), kv


class Decoder(nnx.Module):
    """Pre-norm decoder-only transformer.

    Inputs live on one ragged token axis: all tokens of all sequences in a call, concatenated. Only
    attention looks across tokens, and only within a segment.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.embed = Embed(config.vocab_size, config.d_model, ("vocab", "embed"), dtype, rngs)
        self.pos_embed = (
            Embed(config.max_position, config.d_model, ("positions", "embed"), dtype, rngs)
            if config.architecture == "gpt2"
            else None
        )
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.n_layers)])
        norm = RMSNorm if config.architecture == "llama" else LayerNorm
        self.final_norm = norm(config.d_model, config.norm_eps, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Embed(config.vocab_size, config.d_model, ("vocab", "embed"), dtype, rngs)
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
        kv_caches: list[KVCache] | None,
        logits_index: Int[Array, " S"] | None = None,
        attention: PagedAttention = paged_attention,
    ) -> tuple[Float[Array, "T V"] | Float[Array, "S V"], list[KVCache] | None]:
        """The whole model in one call: with `kv_caches` (one (k_pages, v_pages) per layer) the new
        tokens' K/V are written and attention reads the cache; returns the updated caches. The
        engine runs the same computation as `DecoderStage`s (one, or one per pipeline stage)."""
        x = embed_tokens(self.embed, self.pos_embed, token_ids, meta.positions)
        x, kv_caches = run_layers(self.layers, x, meta, kv_caches, attention)
        return project_logits(self.final_norm, self.embed if self.lm_head is None else self.lm_head, x, logits_index), kv_caches


class DecoderStage(nnx.Module):
    """A contiguous run of a decoder's layers: one pipeline stage's parameters and computation.

    The first stage also embeds the token ids; the last also applies the final norm and the LM head
    (with tied embeddings it holds the embedding matrix for that). It refers to the decoder's own
    submodules (nothing is copied), so `nnx.split(stage)` gives exactly the parameters the stage's
    devices must hold. With one stage it is the whole decoder.
    """

    def __init__(self, decoder: Decoder, layers: range, *, first: bool, last: bool):
        self.first, self.last = first, last
        self.embed = decoder.embed if first else None
        self.pos_embed = decoder.pos_embed if first else None
        self.layers = nnx.List([decoder.layers[i] for i in layers])
        self.final_norm = decoder.final_norm if last else None
        self.head = (decoder.embed if decoder.lm_head is None else decoder.lm_head) if last else None

    def __call__(
        self,
        inputs: Int[Array, " T"] | Float[Array, "T D"],
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        logits_index: Int[Array, " S"],
        attention: PagedAttention,
    ) -> tuple[Float[Array, "T D"] | Float[Array, "S V"], list[KVCache]]:
        """`inputs`: token ids for the first stage, the previous stage's activations otherwise.
        Returns activations [T, D] for the next stage, or, from the last stage, the activations of
        the tokens named by `logits_index` [S, D], for `logits`."""
        x = embed_tokens(self.embed, self.pos_embed, inputs, meta.positions) if self.first else inputs
        x, kv_caches = run_layers(self.layers, x, meta, kv_caches, attention)
        return (x[logits_index] if self.last else x), kv_caches

    def logits(self, x: Float[Array, "S D"]) -> Float[Array, "S V"]:
        """The last stage's final norm and LM head, apart from the layers: the runner compiles this
        per sequence bucket and the layers per token bucket only."""
        return project_logits(self.final_norm, self.head, x, None)


def embed_tokens(embed: Embed, pos_embed: Embed | None, token_ids: Int[Array, " T"],
                 positions: Int[Array, " T"]) -> Float[Array, "T D"]:
    x = embed(token_ids)
    return x if pos_embed is None else x + pos_embed(positions)


def run_layers(layers, x: Float[Array, "T D"], meta: AttentionMetadata, kv_caches: list[KVCache] | None,
               attention: PagedAttention) -> tuple[Float[Array, "T D"], list[KVCache] | None]:
    new_caches = []
    for i, layer in enumerate(layers):
        x, kv = layer(x, meta, None if kv_caches is None else kv_caches[i], attention)
        new_caches.append(kv)
    return x, (None if kv_caches is None else new_caches)


def project_logits(final_norm, head: Embed, x: Float[Array, "T D"],
                   logits_index: Int[Array, " S"] | None) -> Float[Array, "T V"] | Float[Array, "S V"]:
    """Float32 logits at every token, or only at `logits_index` (each sequence's last token when
    generating, which skips most of the LM head)."""
    if logits_index is not None:
        x = x[logits_index]  # [S, D]
    return head.attend(final_norm(x)).astype(jnp.float32)


def init_decoder(config: ModelConfig, seed: int = 0) -> Decoder:
    """A randomly initialised decoder (tests, benchmarks of shapes without weights)."""
    return Decoder(config, rngs=nnx.Rngs(params=jax.random.key(seed)))


def abstract_decoder(config: ModelConfig) -> Decoder:
    """The decoder's structure with ShapeDtypeStructs instead of arrays: allocates nothing, so a
    checkpoint can be restored straight into it and a 175B config can be planned on a laptop."""
    return nnx.eval_shape(lambda: init_decoder(config))
