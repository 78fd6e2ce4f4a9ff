"""The host-side modules must not import jax (docs/design.md, "Rules the code keeps"): they run in
threads and tools that should never touch the device. Every module under engine/ and server/ is one
of them, so a change that needs jax in the engine goes to runner/ (the device side), where it belongs."""

import subprocess
import sys

import pytest

from orca_jax.config import REPO_ROOT

# The folder rule: nothing under these folders imports jax (the device side lives in runner/).
NO_JAX_FOLDERS = ["orca_jax/engine", "orca_jax/server"]
NO_JAX_MODULES = sorted(
    ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
    for folder in NO_JAX_FOLDERS for path in (REPO_ROOT / folder).glob("*.py") if path.name != "__init__.py"
) + [
    "orca_jax.config", "orca_jax.config_loading", "orca_jax.model_config",
    "orca_jax.tokenizer", "orca_jax.cli", "orca_jax.sampling_params", "orca_jax.outputs",
    "orca_jax.sizes", "orca_jax.llm", "orca_jax.parallel.layout", "orca_jax.parallel.plan_cli",
    "orca_jax.parallel.multihost", "orca_jax.parallel.plan_codec", "orca_jax.step_metadata", "orca_jax.host_memory",
]

BLOCK_JAX = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "jax" or name.startswith(("jax.", "jaxlib", "flax")):
            raise ImportError(f"{name} must not be imported here")
sys.meta_path.insert(0, Block())
import importlib
importlib.import_module(sys.argv[1])
"""


@pytest.mark.parametrize("module", NO_JAX_MODULES)
def test_module_imports_without_jax(module):
    result = subprocess.run([sys.executable, "-c", BLOCK_JAX, module], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
