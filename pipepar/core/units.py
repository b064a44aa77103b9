"""Byte sizes: parse what users type ("16GiB", "1.5 TB", 512) and print what tables show.

Binary units (KiB, MiB, GiB, TiB, PiB) are powers of 1024; decimal units (kB, MB, GB, TB, PB)
are powers of 1000, as in the SI and IEC standards. A bare number is a count of bytes.

    >>> parse_bytes("16GiB")
    17179869184
    >>> format_bytes(17179869184)
    '16.0 GiB'
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
    # Shorthands as in `ls -h` and torch memory summaries: K/M/G/T mean binary units.
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "p": 1024**5,
}
_PATTERN = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?)\s*([a-z]*)\s*$", re.I)
_FORMAT_STEPS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def parse_bytes(value: int | float | str, *, name: str = "size") -> int:
    """Turn a byte size given as a number or a string with a unit into a whole number of bytes.

    Args:
        value: an int or float (bytes), or a string such as ``"16GiB"``, ``"1.5 TB"``,
            ``"512MB"``, ``"80G"`` or ``"4096"``. Units are case-insensitive.
        name: the argument's name, used in error messages.

    Returns:
        The size in bytes, rounded down to a whole byte.

    Raises:
        ValueError: for text that is not a size, a negative size, NaN or infinity.
        TypeError: for a value that is neither a number nor a string.

    Example:
        >>> parse_bytes("1.5 KiB")
        1536
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"{name} must be a number of bytes or a string like '16GiB', "
            f"got {type(value).__name__} {value!r}"
        )
    if isinstance(value, str):
        number, unit = _split(value, name)
    else:
        number, unit = float(value) if isinstance(value, float) else value, "b"
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError(f"{name} must be a finite size, got {value!r}; pass e.g. '16GiB'")
    if number < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}; pass e.g. '16GiB'")
    return int(number * _UNITS[unit]) if isinstance(number, float) else number * _UNITS[unit]


def _split(text: str, name: str) -> tuple[int | float, str]:
    """Split ``"1.5 GiB"`` into ``(1.5, "gib")``; ints stay ints so huge sizes stay exact."""
    if text.strip().lower() in ("nan", "inf", "+inf", "-inf", "infinity"):
        raise ValueError(f"{name} must be a finite size, got {text!r}; pass e.g. '16GiB'")
    match = _PATTERN.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit not in _UNITS and unit != ""):
        known = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB (or K, M, G, T)"
        raise ValueError(
            f"{name}={text!r} is not a byte size; write a number and a unit such as "
            f"'16GiB' or '512 MB' (units: {known})"
        )
    digits = match.group(1)
    is_int = re.fullmatch(r"[-+]?\d+", digits) is not None
    return (int(digits) if is_int else float(digits)), (unit or "b")


def format_bytes(n: int | float | None, *, precision: int = 1) -> str:
    """Format a byte count with a binary unit, e.g. ``1536 -> '1.5 KiB'``.

    Args:
        n: the number of bytes; negative values keep their sign; None prints as ``"-"``.
        precision: digits after the decimal point for KiB and larger.

    Returns:
        A short human-readable string.

    Example:
        >>> format_bytes(3 * 1024**3)
        '3.0 GiB'
    """
    if n is None:
        return "-"
    if isinstance(n, float) and not math.isfinite(n):
        return "unlimited" if n > 0 else str(n)
    sign = "-" if n < 0 else ""
    size = float(abs(n))
    step = 0
    while size >= 1024 and step < len(_FORMAT_STEPS) - 1:
        size /= 1024
        step += 1
    if step == 0:
        return f"{sign}{int(size)} B"
    return f"{sign}{size:.{precision}f} {_FORMAT_STEPS[step]}"
