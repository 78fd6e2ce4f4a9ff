"""The GPU image's missing packages, imitated here: with this folder on PYTHONPATH, Python imports
this file at start-up, and from then on `gguf` and `llguidance` (which pyproject installs, but the
GPU image lacks) cannot be imported, as if they were not installed.

    PYTHONPATH=bench/gpu_image python bench/gpu_check.py --smoke

bench/gpu_run.sh --smoke (`make gpu-dry-run`) and tests/test_optional_packages.py run so. Child
processes inherit PYTHONPATH, so the pytest that gpu_check starts is blocked as well."""

import sys
from importlib.abc import MetaPathFinder

MISSING_ON_THE_GPU_IMAGE = ("gguf", "llguidance")


class _NotInstalled(MetaPathFinder):
    """Asked before the real finders: a blocked name (or a module inside it) is not found."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in MISSING_ON_THE_GPU_IMAGE:
            raise ModuleNotFoundError(f"No module named {name!r} (bench/gpu_image: the GPU image lacks it)", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
