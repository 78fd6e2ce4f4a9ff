"""Optional packages, imported where they are used: `gguf` (reading or serving a GGUF file) and
`llguidance` (structured outputs). No jax.

pyproject installs both, but an environment may lack them: the GPU image (Python 3.12 with its own
packages, no network) has neither. There the engine must still import, run a float checkpoint and
serve plain requests; only the feature that needs the package fails, with an error naming it and
the command that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

# What `pip install` needs for each (pyproject's requirement).
PIP_REQUIREMENTS = {"gguf": "gguf>=0.17", "llguidance": "llguidance>=1.0"}


def import_optional(name: str, needed_for: str, error: type[Exception] = ImportError) -> ModuleType:
    """The package `name`; `error` naming it, what needs it and its pip command when it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError as missing:
        raise error(f"{needed_for} needs the Python package {name!r}, which cannot be imported here ({missing}): "
                    f"pip install '{PIP_REQUIREMENTS[name]}'") from missing
