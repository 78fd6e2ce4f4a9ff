"""Which kernels a runner's programs call, decided once for its devices' platform: the attention
(with its KV write, paged_attention.ATTENTION_BACKENDS) and the float matrices' matmul (XLA's dot,
or the native kernel over float32 rows: linear.FloatRowsLinear). Also the one place that asks
whether the native CPU library is there (pallas_kernels.native builds it on first use).

The runner resolves a `Backends` when it is built; quantization.py asks `native_matmuls` when it
gives the quantized matrices their methods. Nothing else names a backend.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

from orca_jax.config import ATTENTION_IMPL_CHOICES, ConfigError, compilation_cache_dir

log = logging.getLogger(__name__)


def native_cache_dir() -> Path:
    """Where the native kernels' library is built: `native/` under the one cache directory."""
    return compilation_cache_dir() / "native"


def native_unavailable() -> str | None:
    """Why the native CPU kernels cannot run in this process (no compiler, a failed build), or None
    when their library is built and loaded."""
    from pallas_kernels.native import unavailable_reason

    return unavailable_reason(native_cache_dir())


@functools.cache  # one line per process and message, however many runners are built
def _warn_once(message: str) -> None:
    log.warning(message)


def native_matmuls() -> bool:
    """Whether quantized matmuls on CPU call the native kernel (warns once when they cannot). Their
    programs hold both lowerings, so the answer does not depend on the platform."""
    reason = native_unavailable()
    if reason is not None:
        _warn_once(f"quantized matmuls on CPU run as XLA's dequantize-then-dot (slower): {reason}")
    return reason is None


def resolve_attention_impl(requested: str, platform: str) -> str:
    """The attention implementation for a device platform ("cpu", "gpu", ...).

    auto: the Pallas kernel on GPU; on CPU the native kernel when it builds and loads, else the XLA
    implementation (one warning says why), since Pallas only interprets there, far slower (see
    docs/kernels.md).
    pallas: compiled on GPU; in interpret mode elsewhere (correct, slow).
    native: the C++ CPU kernel; an error, saying why, when it cannot be built or on another platform.
    xla, pallas-interpret: as named.
    """
    if requested in ("xla", "pallas-interpret"):
        return requested
    if requested == "pallas":
        return "pallas" if platform == "gpu" else "pallas-interpret"
    if requested == "native":
        if platform != "cpu":
            raise ConfigError(f"attention_impl='native' runs on CPU only, not on {platform!r}")
        reason = native_unavailable()
        if reason is not None:
            raise ConfigError(f"attention_impl='native': {reason}")
        return "native"
    if requested == "auto":
        if platform == "gpu":
            return "pallas"
        if platform != "cpu":
            return "xla"
        reason = native_unavailable()
        if reason is None:
            return "native"
        _warn_once(f"native CPU attention unavailable, using the XLA implementation (slower): {reason}")
        return "xla"
    raise ValueError(f"attention_impl={requested!r}; choose one of {list(ATTENTION_IMPL_CHOICES)}")


def resolve_matmul_impl(requested: str, platform: str, dtype: str, tensor_parallel_size: int) -> str:
    """config.MatmulImpl for the devices: "auto" is "native" on CPU for a float32 model at tp = 1 with
    the native library loaded in its AVX2 or AVX-512 variant, "xla" otherwise; "native" where it
    cannot run is refused, saying why."""
    if requested == "xla":
        return "xla"
    reasons = [why for why, fails in (
        (f"it runs on CPU, not on {platform!r}", platform != "cpu"),
        (f"it multiplies float32 matrices; this model runs in {dtype}", dtype != "float32"),
        ("it needs whole matrices on each device (tensor_parallel_size=1)", tensor_parallel_size != 1)) if fails]
    if not reasons:
        unavailable = native_unavailable()
        if unavailable is not None:
            reasons.append(unavailable)
    if not reasons:
        from pallas_kernels import native

        if requested == "auto" and native.isa() == "base":
            # The baseline variant has no fused multiply-add instruction (libm's, lane by lane): it
            # gives the same bits, far slower than XLA's dot.
            return "xla"
        return "native"
    if requested == "native":
        raise ConfigError(f"matmul_impl='native': {'; '.join(reasons)}; use matmul_impl='auto' or 'xla'")
    return "xla"


@dataclasses.dataclass(frozen=True)
class Backends:
    """A runner's kernels, resolved once from the settings for its devices' platform."""

    attention: str  # a key of paged_attention.ATTENTION_BACKENDS: the attention and its KV write
    matmul: str  # the float matrices': "native" (float32 rows, linear.FloatRowsLinear) or "xla"

    @classmethod
    def resolve(cls, platform: str, *, attention_impl: str, matmul_impl: str, dtype: str,
                tensor_parallel_size: int) -> "Backends":
        return cls(attention=resolve_attention_impl(attention_impl, platform),
                   matmul=resolve_matmul_impl(matmul_impl, platform, dtype, tensor_parallel_size))
