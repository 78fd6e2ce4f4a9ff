"""Compiled programs stored between runs: loaded only when everything they depend on matches."""

import json
import logging
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax import LLM, SamplingParams
from orca_jax.config import REPO_ROOT
from orca_jax.runner import compile_cache
from orca_jax.runner.compile_cache import ExecutableStore

DEVICE = jax.devices()[0]
ARGS = (jax.ShapeDtypeStruct((4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(DEVICE)),)


class Program:
    """A small jitted program; counts how often the store had to compile it."""

    def __init__(self, scale: float):
        self.scale, self.compiles = scale, 0

    def get(self, store: ExecutableStore, depends_on: str = "config A"):
        def lower():
            self.compiles += 1
            return jax.jit(lambda x: x * self.scale + 1).lower(*ARGS)

        return store.load_or_compile("double", ARGS, depends_on, lower, jax.tree.structure(0), [DEVICE])


def run(compiled) -> np.ndarray:
    return np.asarray(compiled(jnp.arange(4, dtype=jnp.float32)))


def test_a_stored_program_is_loaded_and_gives_the_same_results(tmp_path):
    first = Program(2.0)
    want = run(first.get(ExecutableStore(tmp_path)))
    store = ExecutableStore(tmp_path)
    second = Program(2.0)
    np.testing.assert_array_equal(run(second.get(store)), want)
    assert (first.compiles, second.compiles, store.loaded) == (1, 0, 1)


# Run in fresh processes: JAX's cache hands back a deserialized executable only from disk.
STEP_SCRIPT = """
import sys, jax, jax.numpy as jnp
from pathlib import Path
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from orca_jax.runner.compile_cache import ExecutableStore
jax.jit(lambda x: x + 1)(1.0)  # any compile first: JAX then takes its cache as on for this process
args = (jax.ShapeDtypeStruct((4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),)
store = ExecutableStore(Path(sys.argv[2]))
compiled = store.load_or_compile("f", args, "", lambda: jax.jit(lambda x: jnp.sin(x) * 2 + x ** 3).lower(*args),
                                 jax.tree.structure(0), jax.devices()[:1])
print(store.loaded, compiled(jnp.arange(4, dtype=jnp.float32)).tolist())
"""


def test_a_program_from_jaxs_own_cache_is_compiled_afresh_for_the_store(tmp_path):
    """An executable that JAX's persistent cache hands back serializes without its machine code
    (jax 0.10.2, CPU); the store must compile its own copy, or the stored file fails when run."""
    def step(store: str) -> str:
        done = subprocess.run([sys.executable, "-c", STEP_SCRIPT, str(tmp_path / "jax"), store], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split(None, 1)

    _, want = step(str(tmp_path / "store A"))  # compiled; JAX's cache must not keep a copy
    assert step(str(tmp_path / "store B")) == ["0", want]  # as after a source edit: compiled again
    assert step(str(tmp_path / "store B")) == ["1", want]  # loaded from the store, and it runs


def test_a_stale_entry_is_ignored_and_rebuilt(tmp_path, monkeypatch):
    Program(2.0).get(ExecutableStore(tmp_path), "config A")
    other_config = Program(3.0)  # what the other config compiles to
    np.testing.assert_array_equal(run(other_config.get(ExecutableStore(tmp_path), "config B")), [1, 4, 7, 10])
    assert other_config.compiles == 1
    monkeypatch.setattr(compile_cache, "source_hash", lambda: "edited source")
    edited = Program(5.0)
    np.testing.assert_array_equal(run(edited.get(ExecutableStore(tmp_path), "config A")), [1, 6, 11, 16])
    assert edited.compiles == 1
    assert len(list(tmp_path.glob("*.exe"))) == 3  # each setting keeps its own entry


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "foreign header"])
def test_a_damaged_file_is_ignored_with_a_warning_and_never_executed(tmp_path, caplog, damage):
    Program(2.0).get(ExecutableStore(tmp_path))
    [path] = tmp_path.glob("*.exe")
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:  # an intact file whose header names other settings: it must not be trusted either
        header_end = data.index(b"\n", len(compile_cache.MAGIC))
        data[len(compile_cache.MAGIC):header_end] = b'{"name": "something else"}'
    path.write_bytes(bytes(data))
    fresh = Program(7.0)  # a different program: running the damaged file would give 2x+1
    with caplog.at_level(logging.INFO, logger="orca_jax.runner.compile_cache"):
        np.testing.assert_array_equal(run(fresh.get(ExecutableStore(tmp_path))), [1, 8, 15, 22])
    assert fresh.compiles == 1
    assert str(path) in caplog.text
    if damage != "foreign header":
        assert "WARNING" in caplog.text and ("checksum" in caplog.text or "not an orca_jax" in caplog.text)


def test_a_second_engine_loads_every_program_instead_of_compiling(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCA_JAX_COMPILATION_CACHE", str(tmp_path))
    settings = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=[16, 32], seq_buckets=[2, 4],
                    show_progress=False)
    prompts = ["3 5", "60 61", "0 4"]
    params = SamplingParams(temperature=0, max_tokens=4)
    first = LLM(REPO_ROOT / "checkpoints" / "tiny", **settings)
    want = [o.outputs[0].token_ids for o in first.generate(prompts, params, use_tqdm=False)]
    assert first.runner.executable_store.loaded == 0
    assert len(list((tmp_path / "executables").glob("*.exe"))) == 4  # 2 token + 2 sequence buckets
    second = LLM(REPO_ROOT / "checkpoints" / "tiny", **settings)
    assert second.runner.executable_store.loaded == 4
    assert [o.outputs[0].token_ids for o in second.generate(prompts, params, use_tqdm=False)] == want
    assert second.num_compilations_after_warmup == 0


def test_the_header_names_the_device_kind_and_platform_version():
    def device(kind, version):
        return types.SimpleNamespace(device_kind=kind, platform="gpu",
                                     client=types.SimpleNamespace(platform_version=version))

    h100 = compile_cache._accelerator([device("NVIDIA H100 80GB HBM3", "PJRT C API\ncuda 12080")])
    h200 = compile_cache._accelerator([device("NVIDIA H200", "PJRT C API\ncuda 12080")])
    newer_driver = compile_cache._accelerator([device("NVIDIA H200", "PJRT C API\ncuda 13000")])
    assert h100["device_kinds"] == ["NVIDIA H100 80GB HBM3"]
    assert len({json.dumps(h) for h in (h100, h200, newer_driver)}) == 3
    here = compile_cache._accelerator([DEVICE])
    assert here["device_kinds"] == [DEVICE.device_kind]
    assert f'"device_kinds": ["{DEVICE.device_kind}"]' in ExecutableStore(None).header("f", ARGS, "", [DEVICE])


def test_a_program_stored_on_one_gpu_model_is_not_loaded_on_another(tmp_path, monkeypatch):
    def on(kind: str, plugins: dict):
        monkeypatch.setattr(compile_cache, "_accelerator",
                            lambda devices: {"device_kinds": [kind], "platform_versions": ["cuda 12080"],
                                             "plugins": plugins})

    cuda12 = {"jax-cuda12-plugin": "0.10.2"}
    on("NVIDIA H100 80GB HBM3", cuda12)
    Program(2.0).get(ExecutableStore(tmp_path))
    for kind, plugins in [("NVIDIA H200", cuda12), ("NVIDIA H100 80GB HBM3", {"jax-cuda12-plugin": "0.11.2"})]:
        on(kind, plugins)
        other = Program(3.0)
        np.testing.assert_array_equal(run(other.get(ExecutableStore(tmp_path))), [1, 4, 7, 10])
        assert other.compiles == 1
    on("NVIDIA H100 80GB HBM3", cuda12)
    store = ExecutableStore(tmp_path)
    again = Program(9.0)
    np.testing.assert_array_equal(run(again.get(store)), [1, 3, 5, 7])  # the H100's own program, loaded
    assert (again.compiles, store.loaded) == (0, 1)
