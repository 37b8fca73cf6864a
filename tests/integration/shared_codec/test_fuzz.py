"""Fuzz targets (hypothesis) for `decode_payload` and the relay message parser (issue 19 item 4).

`decode_payload`: structural mutations of valid payloads. Bytes of the container prefix, the
header (item table included) or the *raw* body are flipped, inserted, deleted or overwritten with
extreme integers; a mutated body is recompressed, the lengths are (usually) fixed up, and the
result is always re-sealed with a valid payload id and digest, so the parser's structural checks,
not just the digest, are what reject it. Property: `PayloadError`, or items whose indices are
strictly increasing and in range with one value per index; never another exception, under 2 s
per example (hypothesis deadline), with decode memory (tracemalloc peak) within a fixed multiple
of the bytes involved.

Relay parser: random bytes, mutated valid frames, JSON objects of a known kind with arbitrary
JSON field values (huge integers, NaN / infinities, deep nesting, odd strings) and non-bytes
frames. Property: `RelayMessageError`, or a message that round-trips with its bounds held.

Default lane: a few hundred examples per target (a few seconds). Slow lane (``-m slow``):
10,000 examples per target.

The long campaigns (slow lane) are here; the short ones in tests/unit/shared_codec/test_fuzz.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from tests.unit.shared_codec.test_fuzz import (
    FAST,
    _run_payload_case,
    check_relay,
    payload_case,
    relay_frame,
)

SLOW = settings(FAST, max_examples=10_000, derandomize=False)


@pytest.mark.slow
@SLOW
@given(payload_case)
def test_fuzz_decode_payload_slow(case: tuple) -> None:
    _run_payload_case(case)


@pytest.mark.slow
@SLOW
@given(relay_frame())
def test_fuzz_relay_parser_slow(frame: object) -> None:
    check_relay(frame)
