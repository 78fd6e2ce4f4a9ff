"""Pallas attention kernels for orca_jax.

The ragged paged attention kernel of the DESIGN.md contract lands here (kernel, jitted wrapper and
pure-jnp reference in one module). Until it does, the model uses the XLA attention in
`orca_jax.model.attention`.
"""
