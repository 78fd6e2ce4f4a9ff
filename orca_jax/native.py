"""`python -m orca_jax.native [--require]`: builds the native CPU kernels (attention, quantized matmul) now, into `native/`
under the one cache directory ($ORCA_JAX_COMPILATION_CACHE), rather than on first use (`make setup`,
the container images, the start-up bench). Says whether it is available and which instruction-set
variant runs. Without --require it never fails (an install goes on; `auto` attention then falls
back to XLA with a warning); with it, an unavailable kernel exits 1 (an image build must not ship
without it)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from orca_jax.model.backends import native_cache_dir, native_unavailable
    from pallas_kernels import native

    reason = native_unavailable()
    if reason is not None:
        print(f"native attention: not available: {reason}")
        return 1 if "--require" in argv else 0
    print(f"native kernels (attention, quantized matmul): built, {native.build(native_cache_dir())} "
          f"({native.isa()} variant)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
