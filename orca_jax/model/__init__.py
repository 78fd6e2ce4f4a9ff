"""The decoder model (Flax NNX), one class for the GPT-2/3 and Llama families.

Axis letters, used in shape comments, einsum strings and jaxtyping annotations throughout:

    T  tokens on the ragged token axis (all requests' tokens concatenated)
    S  sequences (requests) in a batch
    D  model width (d_model)
    F  MLP hidden width (d_ff)
    H  query heads
    K  key/value heads
    G  query heads per key/value head (H = K * G)
    Dh head dimension
    P  KV pages
    V  vocabulary

Parameters carry logical axis names (`LOGICAL_AXES` below); a rules table elsewhere maps them to mesh
axes, so model code never names a mesh axis.
"""

from orca_jax.model.attention import AttentionMetadata
from orca_jax.model.decoder import Decoder, LOGICAL_AXES

__all__ = ["AttentionMetadata", "Decoder", "LOGICAL_AXES"]
