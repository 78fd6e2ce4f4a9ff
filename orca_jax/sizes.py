"""Byte sizes as people write them ("40GiB", "4 GB") and back. This module does not import jax."""

from __future__ import annotations

import argparse
import re

# Binary units are what device memory is sold and reported in (an "A100 40GB" holds 40 GiB);
# decimal units are accepted because people type them too, and mean what they say.
UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
ACCEPTED_FORMS = ("a byte count (1073741824) or a number with B, KiB, MiB, GiB, TiB (binary) "
                  "or KB, MB, GB, TB (decimal), e.g. 40GiB")

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str | int) -> int:
    """'40GiB' -> 42949672960. Fractions are allowed ('1.5GiB') and rounded down to whole bytes."""
    match = _SIZE.fullmatch(str(text))
    unit = match and UNITS.get(match.group(2).lower())
    if unit is None:
        raise ValueError(f"cannot read {text!r} as a size; give {ACCEPTED_FORMS}")
    number = match.group(1)
    if "." not in number:
        return int(number) * unit  # exact for large integers
    return int(float(number) * unit)


def byte_size(text: str) -> int:
    """argparse `type=` for size flags: the error names the accepted forms (argparse hides a ValueError's text)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def format_bytes(n: int | float) -> str:
    """Binary units with two decimals: '40.00 GiB', '12.50 MiB', '512 B'."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
