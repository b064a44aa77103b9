"""Byte sizes: parsing what users type and formatting what tables show."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipepar.core.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 1024**3),
        ("16 gib", 16 * 1024**3),
        ("1.5 TB", 1_500_000_000_000),
        ("512MB", 512_000_000),
        ("512 MiB", 512 * 1024**2),
        ("80G", 80 * 1024**3),
        ("4096", 4096),
        ("1.5 KiB", 1536),
        ("2kB", 2000),
        (" 7 B ", 7),
        ("1e3", 1000),
        ("0", 0),
    ],
)
def test_parse_bytes_units(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_numbers_and_exact_huge_ints() -> None:
    assert parse_bytes(123) == 123
    assert parse_bytes(2.7) == 2
    # Integers stay exact even where floats would round.
    assert parse_bytes("9007199254740993 B") == 9007199254740993
    assert parse_bytes("3 PiB") == 3 * 1024**5


@pytest.mark.parametrize("bad", ["abc", "16 GiBs", "GiB", "", "1..2 GB", "12 parsecs"])
def test_parse_bytes_rejects_text_that_is_not_a_size(bad: str) -> None:
    with pytest.raises(ValueError, match="not a byte size") as err:
        parse_bytes(bad, name="capacity")
    assert "capacity" in str(err.value) and "16GiB" in str(err.value)


@pytest.mark.parametrize("bad", [-1, -0.5, "-3 GiB", "-1"])
def test_parse_bytes_rejects_negative_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        parse_bytes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.nan, math.inf, "nan", "inf", "-inf", "NaN GiB"])
def test_parse_bytes_rejects_nan_and_infinity(bad: object) -> None:
    with pytest.raises(ValueError, match=r"finite|not a byte size"):
        parse_bytes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [None, True, [1], {"a": 1}])
def test_parse_bytes_rejects_other_types(bad: object) -> None:
    with pytest.raises(TypeError, match="size must be a number of bytes"):
        parse_bytes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (80 * 1024**3, "80.0 GiB"),
        (-2 * 1024**2, "-2.0 MiB"),
        (None, "-"),
        (math.inf, "unlimited"),
    ],
)
def test_format_bytes(n: int | float | None, text: str) -> None:
    assert format_bytes(n) == text


@given(st.integers(min_value=0, max_value=2**60))
def test_formatted_sizes_parse_back_within_rounding(n: int) -> None:
    text = format_bytes(n, precision=3)
    back = parse_bytes(text)
    assert abs(back - n) <= max(1, n * 0.001)
