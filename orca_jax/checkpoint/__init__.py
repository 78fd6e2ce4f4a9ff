"""Checkpoints: orbax save/restore, GGUF and HF safetensors import, `pull` of the default model."""

from orca_jax.checkpoint.store import (
    CheckpointError,
    LoadedModel,
    checkpoint_root,
    load_model,
    resolve_checkpoint_dir,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "LoadedModel",
    "checkpoint_root",
    "load_model",
    "resolve_checkpoint_dir",
    "save_checkpoint",
]
