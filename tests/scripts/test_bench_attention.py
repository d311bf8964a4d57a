"""scripts/bench_attention.py: `--decode-rows` takes BxC rows and rejects anything else with the expected form."""

from __future__ import annotations

import argparse

import pytest

from scripts.bench_attention import parse_decode_row


def test_decode_rows_parse_as_sequences_by_keys():
    assert parse_decode_row("147x384") == (147, 384)


@pytest.mark.parametrize("text", ["147", "147x", "x384", "147y384", "0x384", "147x-1", "1x2x3"])
def test_a_malformed_decode_row_names_the_expected_form(text):
    with pytest.raises(argparse.ArgumentTypeError, match="BxC|positive"):
        parse_decode_row(text)
