"""The host-side modules must not import jax (DESIGN.md): they run in threads and tools that
should never touch the device."""

import subprocess
import sys

import pytest

NO_JAX_MODULES = [
    "orca_jax.config", "orca_jax.tokenizer", "orca_jax.cli", "orca_jax.sampling_params", "orca_jax.outputs",
    "orca_jax.engine.request", "orca_jax.engine.kv_manager", "orca_jax.engine.scheduler",
    "orca_jax.engine.detokenizer", "orca_jax.engine.step_plan", "orca_jax.engine.engine",
    "orca_jax.engine.async_engine", "orca_jax.engine.structured_output", "orca_jax.parallel.multihost",
    "orca_jax.server.protocol", "orca_jax.server.responses", "orca_jax.server.metrics", "orca_jax.server.app", "orca_jax.server.state",
    "orca_jax.server.handlers", "orca_jax.server.serve", "orca_jax.server.tool_calls",
    "orca_jax.sizes", "orca_jax.parallel.layout", "orca_jax.parallel.plan_cli",
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
