"""The bench scripts are not a package: put bench/ on the path so tests import them as the scripts do."""

import sys

from orca_jax.config import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
