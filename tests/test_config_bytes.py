"""Tests for ectier.config's byte counts: ``parse_bytes`` (units, exactness, bits spellings, the
2**63 - 1 ceiling) and ``format_bytes``."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ectier.config import HostTierConfig, format_bytes, parse_bytes
from ectier.errors import ConfigError

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4

# ------------------------------------------------------------------------------ parse_bytes

UNIT_FACTORS = {
    "": 1, "B": 1, "b": 1,
    "K": 10**3, "KB": 10**3, "kb": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12, "TB": 10**12,
    "KiB": 2**10, "kib": 2**10, "MiB": 2**20, "GiB": 2**30, "GIB": 2**30, "TiB": 2**40,
    "PiB": 2**50, "pib": 2**50, "P": 10**15, "PB": 10**15, "EiB": 2**60, "E": 10**18, "EB": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4GiB", 4 * 2**30),
        ("2GB", 2 * 10**9),
        ("1.5KiB", 1536),
        ("512 MB", 512 * 10**6),
        ("  64MiB  ", 64 * 2**20),
        ("1048576", 1048576),
        ("0", 0),
        ("0.5KiB", 512),
        ("0.25MB", 250_000),
        ("1TiB", 2**40),
    ],
)
def test_parse_bytes_examples(text, expected):
    assert parse_bytes(text) == expected
    assert type(parse_bytes(text)) is int


@pytest.mark.parametrize(
    "bad",
    ["", "GiB", "4 GiBs", "4XB", "-1", "-1GiB", "1.5", "0.3B", "1e9", "4 G i B", "1,000", "0x10", "1.2.3KiB", "nan"],
)
def test_parse_bytes_rejects_bad_strings(bad):
    with pytest.raises(ConfigError, match="^host.capacity_bytes:"):
        parse_bytes(bad, field_name="host.capacity_bytes")


@pytest.mark.parametrize("huge", [2**63, 10**30, "10000000EiB", str(10**30)])
def test_byte_counts_past_2_63_are_refused_naming_the_field(huge):
    with pytest.raises(ConfigError, match=r"^host.capacity_bytes: .*more than any machine has"):
        parse_bytes(huge, field_name="host.capacity_bytes")
    with pytest.raises(ConfigError, match=r"host.capacity_bytes: .*more than any machine has"):
        HostTierConfig(capacity_bytes=huge)


@pytest.mark.parametrize("bits", ["10Mb", "1Gb", "4 Kb", "2GIb", "3Tib"])
def test_parse_bytes_refuses_bits_spelling(bits):
    with pytest.raises(ConfigError, match=r"^host.capacity_bytes: .* reads as bits.*write bytes, e.g. '\d+[KMGT]iB'"):
        parse_bytes(bits, field_name="host.capacity_bytes")


@pytest.mark.parametrize("bad", [-1, -(2**40), True, False, 1.0, 2.5, None, b"4GiB", [4]])
def test_parse_bytes_rejects_bad_values(bad):
    with pytest.raises(ConfigError, match="^field:"):
        parse_bytes(bad, field_name="field")


@given(st.integers(min_value=0, max_value=2**63 - 1))
def test_parse_bytes_int_and_decimal_string_are_exact(n):
    assert parse_bytes(n) == n
    assert parse_bytes(str(n)) == n  # no float rounding, even past 2**53


@settings(max_examples=200)
@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(sorted(UNIT_FACTORS)))
def test_parse_bytes_units(n, unit):
    assume(n * UNIT_FACTORS[unit] < 2**63)  # (beyond: refused, test_byte_counts_past_2_63_are_refused_...)
    assert parse_bytes(f"{n}{unit}") == n * UNIT_FACTORS[unit]
    assert parse_bytes(f"{n} {unit}".strip()) == n * UNIT_FACTORS[unit]


@given(st.integers(min_value=0, max_value=2**40), st.integers(min_value=1, max_value=9))
def test_parse_bytes_fractions_of_kib(n, tenths):
    text = f"{n}.{tenths}KiB"
    if tenths == 5:  # x.5 KiB = x KiB + 512 B; every other tenth of 1024 is fractional
        assert parse_bytes(text) == n * 1024 + 512
    else:
        with pytest.raises(ConfigError, match="whole number"):
            parse_bytes(text)


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(33423360) == "31.9 MiB"
    assert format_bytes(3 * TiB) == "3.0 TiB"
    assert format_bytes(5000 * TiB) == "5000.0 TiB"
