"""llama.cpp's own tokenizer test vectors, held to the tokenizers we build from its GGUF files.

llama.cpp ships vocabulary-only GGUF files of real models (models/ggml-vocab-<name>.gguf) with test
texts (.inp, separated by SEPARATOR) and the ids each model's own Hugging Face tokenizer gives for them
(.out, one line a text, no BOS). Every file whose tokenizer we build must give those ids for every text;
the others must be refused, naming what is not supported.

The files are those of llama.cpp as vendored in the llama-cpp-python sdist on PyPI (VERSION). They are
looked for in build/llama.cpp (where bench/llama_cpp.sh unpacks that sdist), then in this test's copy
under the data directory (orca_jax.paths.data_home()); else the sdist is downloaded once with pip
(76 MB) and only the vocabulary files are kept there. Without them the test fails, saying what to fetch.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from orca_jax.checkpoint.gguf_import import GGUFImportError, gguf_tokenizer
from orca_jax.checkpoint.gguf_reader import GGUFReader
from orca_jax.config import REPO_ROOT
from orca_jax.paths import data_home

VERSION = "0.3.36"
REQUIREMENT = f"llama-cpp-python=={VERSION}"
BUILD = REPO_ROOT / "build" / "llama.cpp"
SEPARATOR = "\n__ggml_vocab_test__\n"
# Every vocabulary of VERSION that comes with test vectors: ours must give its ids ...
MATCHED = ("command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "llama-bpe", "llama-spm", "mpt",
           "phi-3", "qwen2", "qwen35", "refact", "starcoder")
# ... or refuse it with an error that says this.
REFUSED = {"bert-bge": "tokenizer.ggml.model='bert' is not supported",  # WordPiece
           "gemma-4": "tokenizer.ggml.model='gemma4' is not supported"}
NAMES = (*MATCHED, *REFUSED)


def _has_every_file(folder: Path) -> bool:
    return all((folder / f"ggml-vocab-{name}.gguf{suffix}").is_file() for name in NAMES for suffix in ("", ".inp", ".out"))


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    return find_vocab_dir()


def find_vocab_dir() -> Path:
    unpacked = BUILD / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp" / "models"
    if _has_every_file(unpacked):
        return unpacked
    kept = data_home() / f"llama-cpp-vocab-{VERSION}"
    if _has_every_file(kept):
        return kept
    with tempfile.TemporaryDirectory() as tmp:
        sdist = BUILD / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            sdist = _download_sdist(Path(tmp))
        _keep_vocab_files(sdist, kept)
    if not _has_every_file(kept):
        pytest.fail(f"{sdist.name} lacks some of the vocabulary files {NAMES}; this test is written for "
                    f"{REQUIREMENT}'s")
    return kept


def _download_sdist(folder: Path) -> Path:
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                             REQUIREMENT, "-d", str(folder)], capture_output=True, text=True)
    sdists = sorted(folder.glob("*.tar.gz"))
    if result.returncode != 0 or not sdists:
        lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
        pytest.fail(f"llama.cpp's tokenizer test files could not be fetched: `pip download --no-deps --no-binary "
                    f":all: {REQUIREMENT}` failed ({lines[-1] if lines else result.returncode}). Check the network, "
                    f"or fetch that sdist elsewhere and put it in {BUILD}/")
    return sdists[0]


def _keep_vocab_files(sdist: Path, folder: Path) -> None:
    """Writes the sdist's models/ggml-vocab-* files into `folder`, whole or not at all (a folder left
    half written by an interrupted run would pass for complete)."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        for member in archive:
            name = member.name.rpartition("/")[2]
            if member.isfile() and re.fullmatch(r".*/vendor/llama\.cpp/models/ggml-vocab-[^/]+", member.name):
                (partial / name).write_bytes(archive.extractfile(member).read())
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def _vectors(vocab_dir: Path, name: str) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs, read as llama.cpp's test-tokenizer-0 reads them."""
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    if texts[-1] == "":  # the file ends with a separator
        texts.pop()
    lines = Path(f"{path}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), f"{path}: {len(texts)} texts, {len(lines)} lines of ids"
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def _tokenizer(vocab_dir: Path, name: str):
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    return gguf_tokenizer(GGUFReader(path), path)  # the reader `orca-jax convert` uses


@pytest.mark.parametrize("name", MATCHED)
def test_ids_equal_the_models_own_tokenizer(vocab_dir, name):
    tokenizer = _tokenizer(vocab_dir, name)  # built once per file: reading a large vocabulary takes seconds
    vectors = _vectors(vocab_dir, name)
    wrong = [(text, got, want) for text, want in vectors
             if (got := tokenizer.encode(text, add_bos=False)) != want]
    assert not wrong, f"{len(wrong)} of {len(vectors)} texts differ (text, ours, theirs): {wrong}"


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_vocabularies_are_refused_naming_what(vocab_dir, name):
    with pytest.raises(GGUFImportError, match=re.escape(REFUSED[name])):
        _tokenizer(vocab_dir, name)


def test_every_vocabulary_with_vectors_is_checked(vocab_dir):
    """A vocabulary with vectors that neither list names (another llama.cpp version) fails here."""
    with_vectors = {path.name.removeprefix("ggml-vocab-").removesuffix(".gguf.inp")
                    for path in vocab_dir.glob("ggml-vocab-*.gguf.inp")}
    assert sorted(with_vectors) == sorted(NAMES)
