"""Compiled buckets: the fixed set of shapes every step is padded to, so nothing compiles after warmup.

A step is ragged: decode rows (one token each) and prefill chunks share one forward. Its shape is a token bucket T
(the step's tokens, padded); the sequence count S and the page-table width P follow from T and the engine's limits
(`seqs_for`, `max_pages_per_seq`), so the number of compiled forwards is the number of token buckets, whatever the
mix; with `decode_programs`, each bucket a step of decode rows alone can take has a second program for those steps
(`programs`: on GPU their attention launches its decode kernel alone). `pick` returns the smallest bucket that fits.
A step whose requests adjust their logits (penalties, logit_bias, min_new_tokens) sends one entry per (row, token id)
a rule touches, padded to an entry bucket: S times a per-row budget from `logit_entries_per_row`
(sampling/logit_adjustments.py).

Where it sits: configs, at the bottom of the package: the scheduler and EngineCore pad each step to these shapes,
the LoRA manager and the logit adjustments pick their buckets with `pick` and `checked_buckets` (the LoRA segment
buckets from `segment_buckets`), and the model runner compiles one program per bucket.
"""

from __future__ import annotations

import dataclasses

MIN_TOKEN_BUCKET = 8  # on GPU a 1-row matmul compiles to a slower kernel than an 8-row one; decode is memory-bound
MIN_PREFILL_TOKENS = 32  # prefill tokens a step may take however many decode rows it holds (managers/scheduler.py)
MIN_LOGIT_ENTRIES_PER_ROW = 16  # the smallest entry bucket of logit adjustments is S times this
LOGIT_ENTRY_GROWTH = 16  # each entry bucket is this many times the one before (few buckets: few programs)


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    values, v = [], lo
    while v < hi:
        values.append(v)
        v *= 2
    values.append(hi)
    return tuple(sorted(set(values)))


@dataclasses.dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]  # compiled step token counts T
    max_seqs: int  # most sequences in one step (--max-running-requests)
    max_pages_per_seq: int  # page-table width P of every step (the context's pages)
    logit_entries_per_row: tuple[int, ...] = (MIN_LOGIT_ENTRIES_PER_ROW,)  # entry buckets of logit adjustments / S
    decode_programs: bool = False  # steps of decode rows alone run programs of their own (--decode-step-programs)

    @classmethod
    def build(
        cls,
        max_running_requests: int,
        chunked_prefill_size: int,
        context_length: int,
        page_size: int,
        token_buckets: list[int] | None = None,
        max_logit_entries_per_row: int = MIN_LOGIT_ENTRIES_PER_ROW,
        decode_programs: bool = False,
    ) -> Buckets:
        """Token buckets from MIN_TOKEN_BUCKET up to the most tokens a step holds: the chunk budget, or every running
        request's decode row plus MIN_PREFILL_TOKENS; powers of two unless `--token-buckets` says otherwise.
        max_logit_entries_per_row: the most logit-adjustment entries one request can have (the top entry budget)."""
        if page_size > context_length:
            raise ValueError(
                f"--page-size {page_size} is larger than the context length {context_length}: every request would "
                f"hold a page of mostly unused KV memory; use a page size of at most {context_length} (16 is usual)"
            )
        max_pages = -(-context_length // page_size)
        max_tokens = max(chunked_prefill_size, max_running_requests + min(chunked_prefill_size, MIN_PREFILL_TOKENS))
        tokens = checked_buckets("--token-buckets", token_buckets, max_tokens) or powers_of_two(
            min(MIN_TOKEN_BUCKET, max_tokens), max_tokens
        )
        return cls(
            tokens=tokens,
            max_seqs=max_running_requests,
            max_pages_per_seq=max_pages,
            logit_entries_per_row=logit_entry_budgets(max_logit_entries_per_row),
            decode_programs=decode_programs,
        )

    def seqs_for(self, num_tokens: int) -> int:
        """Sequences S of the bucket with num_tokens tokens: every sequence of a step has at least one token."""
        return min(num_tokens, self.max_seqs)

    def shapes(self) -> list[tuple[int, int]]:
        """(S, T) of every compiled step."""
        return [(self.seqs_for(t), t) for t in self.tokens]

    def programs(self) -> list[tuple[int, int, bool]]:
        """(S, T, decode_only) of every compiled forward: each shape for steps of any mix, then, with
        decode_programs, for steps of decode rows alone each shape up to the bucket of max_seqs rows."""
        programs = [(s, t, False) for s, t in self.shapes()]
        if self.decode_programs:
            largest = pick(self.tokens, self.max_seqs)  # the bucket of the most decode rows a step holds
            programs += [(s, t, True) for s, t in self.shapes() if t <= largest]
        return programs

    def sample_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({self.seqs_for(t) for t in self.tokens}))

    def logit_entry_sizes(self, num_seqs: int) -> tuple[int, ...]:
        """Entry buckets N of the logit adjustments of a step of num_seqs sequences (bucket S)."""
        return tuple(num_seqs * budget for budget in self.logit_entries_per_row)


def logit_entry_budgets(max_per_row: int) -> tuple[int, ...]:
    """Per-row entry budgets: MIN_LOGIT_ENTRIES_PER_ROW growing by LOGIT_ENTRY_GROWTH, then max_per_row; a budget
    within a factor 4 of max_per_row gives way to it."""
    budgets, budget = [], MIN_LOGIT_ENTRIES_PER_ROW
    while budget * 4 <= max_per_row:
        budgets.append(budget)
        budget *= LOGIT_ENTRY_GROWTH
    return tuple(budgets) + (max(max_per_row, 1),)


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
    # sizes above the limit become the limit (e.g. --token-buckets 4096 with a 2048-token budget)
    return tuple(sorted({min(v, limit) for v in values} | {limit}))


SMALL_SEGMENT_BUCKET_MIN_SLOTS = 16


def segment_buckets(num_slots: int, requested: list[int] | None = None) -> tuple[int, ...]:
    """Compiled segment counts G (distinct slots in a step, base included): `--lora-segment-buckets`, else all
    slots, plus a bucket of 4 when the pool has more than SMALL_SEGMENT_BUCKET_MIN_SLOTS slots; all slots
    (num_slots) is always one of them.

    Kernels walk G segments (the Pallas kernels' work list is tokens / tile + G - 1 items; sgmv gathers G
    adapters; einsum ignores G), so with a large pool, batches with few adapters run a small bucket. Each bucket adds
    one compiled program per token bucket; with a small pool the small bucket saves little and costs those programs
    at startup.
    """
    default = {min(4, num_slots), num_slots} if num_slots > SMALL_SEGMENT_BUCKET_MIN_SLOTS else {num_slots}
    return checked_buckets("--lora-segment-buckets", requested, num_slots) or tuple(sorted(default))
