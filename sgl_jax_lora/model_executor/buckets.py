"""Compiled buckets: the fixed set of shapes every step is padded to, so nothing compiles after warmup.

Extend (prefill) steps: (sequences S, tokens T) with pages per sequence fixed at the context's maximum.
Decode steps: (sequences S, pages per sequence P). `pick` returns the smallest bucket that fits. An extend step's
queries are laid out in rows of tokens of one sequence (`extend_query_layout`).
"""

from __future__ import annotations

import dataclasses

MIN_DECODE_BUCKET = 8
EXTEND_QUERY_TILE = 128  # fewest query tokens per attention row in extend steps (a TPU lane width)


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    values, v = [], lo
    while v < hi:
        values.append(v)
        v *= 2
    values.append(hi)
    return tuple(sorted(set(values)))


@dataclasses.dataclass(frozen=True)
class Buckets:
    decode_seqs: tuple[int, ...]
    decode_pages: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    prefill_seqs: tuple[int, ...]
    max_pages_per_seq: int

    @classmethod
    def build(
        cls,
        max_running_requests: int,
        chunked_prefill_size: int,
        max_prefill_seqs: int,
        context_length: int,
        page_size: int,
        decode_batch_buckets: list[int] | None = None,
        prefill_token_buckets: list[int] | None = None,
        decode_page_buckets: list[int] | None = None,
        prefill_seq_buckets: list[int] | None = None,
    ) -> "Buckets":
        max_pages = -(-context_length // page_size)
        chunked_prefill_size = min(chunked_prefill_size, context_length)  # no prompt chunk exceeds the context
        # Decode starts at 8 sequences: on GPU a 1-row matmul compiles to a slower kernel than an 8-row one
        # (measured, docs/benchmarks.md), and decode is memory-bound, so the padding costs nothing.
        decode_seqs = checked_buckets("--decode-batch-buckets", decode_batch_buckets, max_running_requests) or powers_of_two(
            min(MIN_DECODE_BUCKET, max_running_requests), max_running_requests
        )
        prefill_tokens = checked_buckets("--prefill-token-buckets", prefill_token_buckets, chunked_prefill_size) or powers_of_two(
            min(32, chunked_prefill_size), chunked_prefill_size
        )
        decode_pages = checked_buckets("--decode-page-buckets", decode_page_buckets, max_pages) or powers_of_two(
            min(4, max_pages), max_pages
        )
        return cls(
            decode_seqs=decode_seqs,
            decode_pages=decode_pages,
            prefill_tokens=prefill_tokens,
            prefill_seqs=checked_buckets("--prefill-seq-buckets", prefill_seq_buckets, max_prefill_seqs)
            or powers_of_two(1, max_prefill_seqs),
            max_pages_per_seq=max_pages,
        )

    def extend_shapes(self) -> list[tuple[int, int]]:
        return [(s, t) for s in self.prefill_seqs for t in self.prefill_tokens if s <= t]

    def decode_shapes(self) -> list[tuple[int, int]]:
        return [(s, p) for s in self.decode_seqs for p in self.decode_pages]

    def sample_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.decode_seqs) | set(self.prefill_seqs)))


def extend_query_layout(num_seqs: int, num_tokens: int) -> tuple[int, int]:
    """-> (rows R, tile Q) of an extend step's query layout. Each sequence's n new tokens fill ceil(n / Q) rows, so
    R rows hold any split of num_tokens over at most num_seqs sequences, and attention scores cost R * Q (about
    T + S * Q) query rows per key instead of S * T with one row of T per sequence. Q is at least T / S: one
    sequence keeps a single row of T (each row is one iteration of attention's loop, and a row gathers its
    sequence's keys again; measured in docs/benchmarks.md, "Session 8")."""
    tile = min(num_tokens, max(EXTEND_QUERY_TILE, num_tokens // num_seqs))
    return (num_tokens + num_seqs * (tile - 1)) // tile, tile


def pick(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def checked_buckets(flag: str, values: list[int] | None, limit: int) -> tuple[int, ...] | None:
    """A bucket flag's sizes, sorted, capped at `limit` and always including it; None when the flag is unset."""
    if not values:
        return None
    values = tuple(sorted(set(int(v) for v in values)))
    if values[0] < 1:
        raise ValueError(f"{flag} must be positive integers, got {values}")
    # sizes above the limit become the limit (e.g. --prefill-token-buckets 2048 with a 1024-token context)
    return tuple(sorted({min(v, limit) for v in values} | {limit}))
