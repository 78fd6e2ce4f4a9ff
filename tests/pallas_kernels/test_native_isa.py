"""Every instruction-set variant of the native kernel this CPU can run, forced one by one: each
against the reference, and each against the best variant. An AVX-512 machine thus also tests the
code an AVX2-only CPU runs (and the baseline x86-64 code), which it would otherwise never execute."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native, ragged_paged_attention_reference

from ..conftest import require_native
from .test_ragged_paged_attention import lengths, make_batch


def float_variants() -> list[str]:
    """The variants this CPU has with distinct float code: a VNNI variant runs its AVX-512 or AVX2
    sibling's attention and float matmul (native.FLOAT_CODE), so it is tested once, under that name."""
    return [name for name in native.supported_isas() if native.FLOAT_CODE[name] == name]


@pytest.fixture
def restore_isa():
    require_native()
    chosen = native.isa()
    yield
    native.select_isa(chosen)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])  # a head of whole vectors, and one padded to them
def test_every_variant_matches_the_reference_and_the_best_variant(restore_isa, dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    seqs = [(n, 1) for n in lengths(16)] + [(n, n) for n in lengths(16)] + [(50, 17)]
    args = make_batch(rng, page_size=16, num_heads=9, num_kv_heads=3, head_dim=head_dim, seqs=seqs, dtype=dtype)
    scale = 1.0 / np.sqrt(head_dim)
    want = np.asarray(ragged_paged_attention_reference(*args, sm_scale=scale), np.float32)
    variants = native.supported_isas()
    assert variants[-1] == "base" and native.isa() in variants  # the best, unless $ORCA_JAX_NATIVE_ISA chose one
    outputs = {}
    for name in float_variants():
        native.select_isa(name)
        assert native.isa() == name
        outputs[name] = np.asarray(native.ragged_paged_attention_native(*args, sm_scale=scale), np.float32)
        tolerance = 1e-5 if dtype == jnp.float32 else 2e-3  # bf16 output: 8 bits of mantissa
        np.testing.assert_allclose(outputs[name], want, atol=tolerance, rtol=tolerance, err_msg=name)
    # AVX2 and AVX-512 run the same fused multiply-adds in the same order: identical bits, so an
    # AVX2-only CPU attends exactly as an AVX-512 one. The baseline has no FMA and rounds a little
    # differently.
    if "avx2" in outputs and "avx512" in outputs:
        np.testing.assert_array_equal(outputs["avx2"], outputs["avx512"])
    np.testing.assert_allclose(outputs["base"], outputs[float_variants()[0]], atol=1e-6 if dtype == jnp.float32 else 2e-3)


def test_a_variant_the_cpu_lacks_or_does_not_know_is_refused(restore_isa):
    with pytest.raises(ValueError, match="variants are avx512vnni, avx512, avxvnni, avx2, base"):
        native.select_isa("sse2")
    missing = [name for name in native.ISAS if name not in native.supported_isas()]
    for name in missing:
        with pytest.raises(ValueError, match=f"cannot run the {name} variant"):
            native.select_isa(name)


@pytest.mark.multiprocess
def test_the_environment_variable_forces_a_variant_for_the_whole_process():
    require_native()
    import os
    import subprocess
    import sys

    script = ("from orca_jax.model.backends import native_cache_dir\n"
              "from pallas_kernels import native\n"
              "assert native.unavailable_reason(native_cache_dir()) is None\n"
              "print(native.isa())")
    env = {**os.environ, native.ISA_ENV: "base"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "base"
