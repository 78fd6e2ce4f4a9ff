#!/usr/bin/env bash
# Wheels of the Python packages that orca_jax uses and the GPU image lacks, for CPython 3.12 on
# x86-64 Linux, into gpu_wheels/ (git-ignored), so they can travel with a GPU run: name the folder
# in the device tool's `carry`, and bench/gpu_run.sh installs them there (pip install --no-index).
#
#   bench/gpu_wheels.sh            # here, where pip reaches PyPI; prints the folder's size
#
# The run needs none of them: both are imported only by the features that use them (orca_jax/
# optional.py): gguf reads or serves GGUF files, llguidance runs structured outputs. Carried, those
# features work there too. Their own requirements (gguf: numpy, pyyaml, requests, tqdm; llguidance:
# none) are in the image (/work/.library/device/KINDS.md's list), so --no-deps: a second numpy on
# the path would shadow the image's.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(gguf llguidance)
DEST=gpu_wheels
PYTHON=${PYTHON:-.venv/bin/python}

# The versions this checkout is tested with (its venv's), else the newest pyproject allows.
requirements=()
for name in "${PACKAGES[@]}"; do
    version=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null || true)
    requirements+=("$name${version:+==$version}")
done

rm -rf "$DEST"
# pip matches a manylinux tag exactly: list the usual ones (llguidance 1.9 is tagged manylinux_2_31,
# for glibc 2.31 or newer; the image's glibc is not recorded, its Python 3.12.3 is Ubuntu 24.04's, 2.39).
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$DEST" "${requirements[@]}"
ls -l "$DEST"
echo "$(du -sh "$DEST" | cut -f1) in $DEST (the device tool carries at most 64 MiB with the whole working tree)"
