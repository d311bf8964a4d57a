"""Buckets (configs/buckets.py): the token buckets every step is padded to, the sequence count each implies,
`pick` (the smallest bucket that fits) and the checks of --token-buckets."""

from __future__ import annotations

import pytest

from sgl_jax_lora.configs.buckets import (
    MIN_PREFILL_TOKENS,
    MIN_TOKEN_BUCKET,
    Buckets,
    checked_buckets,
    pick,
    powers_of_two,
)


def test_powers_of_two_end_at_the_limit():
    assert powers_of_two(8, 64) == (8, 16, 32, 64)
    assert powers_of_two(8, 100) == (8, 16, 32, 64, 100)
    assert powers_of_two(8, 8) == (8,)


def test_build_covers_the_chunk_or_every_decode_row_plus_a_prefill_share():
    buckets = Buckets.build(max_running_requests=4, chunked_prefill_size=64, context_length=1000, page_size=16)
    assert buckets.tokens == (MIN_TOKEN_BUCKET, 16, 32, 64)
    assert buckets.max_pages_per_seq == 63  # ceil(1000 / 16)
    many = Buckets.build(max_running_requests=100, chunked_prefill_size=64, context_length=1000, page_size=16)
    assert many.tokens[-1] == 100 + MIN_PREFILL_TOKENS


def test_a_step_budget_above_the_context_is_kept():
    """A step's tokens span many prompts: a 4096-token budget over a 256-token context is a 4096-token step (every
    prompt's chunk stays within its own context)."""
    buckets = Buckets.build(max_running_requests=2, chunked_prefill_size=4096, context_length=256, page_size=16)
    assert buckets.tokens[-1] == 4096 and buckets.max_pages_per_seq == 16
    given = Buckets.build(1024, 8192, 1536, 16, token_buckets=[64, 256, 512, 1024, 2048, 4096, 8192])
    assert given.tokens == (64, 256, 512, 1024, 2048, 4096, 8192)  # nothing of the flag's buckets is dropped


def test_a_page_larger_than_the_context_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--page-size 4096 is larger than the context length 2048"):
        Buckets.build(8, 512, 2048, 4096)
    assert Buckets.build(8, 512, 2048, 2048).max_pages_per_seq == 1  # one page of the whole context


def test_sequences_follow_the_tokens_up_to_max_seqs():
    buckets = Buckets.build(max_running_requests=12, chunked_prefill_size=64, context_length=256, page_size=16)
    assert [buckets.seqs_for(t) for t in buckets.tokens] == [8, 12, 12, 12]
    assert buckets.shapes() == [(8, 8), (12, 16), (12, 32), (12, 64)]
    assert buckets.sample_sizes() == (8, 12)


def test_explicit_token_buckets_are_sorted_capped_and_include_the_limit():
    buckets = Buckets.build(
        max_running_requests=4,
        chunked_prefill_size=64,
        context_length=256,
        page_size=16,
        token_buckets=[48, 16, 4096, 16],
    )
    assert buckets.tokens == (16, 48, 64)
    assert checked_buckets("--token-buckets", None, 64) is None
    with pytest.raises(ValueError, match="--token-buckets must be positive"):
        checked_buckets("--token-buckets", [0, 8], 64)


def test_pick_returns_the_smallest_bucket_that_fits():
    assert [pick((8, 16, 64), n) for n in (1, 8, 9, 64)] == [8, 8, 16, 64]
    with pytest.raises(ValueError, match="65 exceeds the largest bucket 64"):
        pick((8, 16, 64), 65)
