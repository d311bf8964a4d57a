"""The steps `bench_step.py` and `ab_step.py` time: a case's text, its sequences, its KV pages and the ForwardBatch
the engine would hand the model for it, with the adapters laid out as the engine batches them.

    decode:SxC      S sequences of context C, one new token each (the engine's decode step: bucket S tokens)
    decode:SxC@B    the same S rows padded to a bucket of B tokens and B sequences, as the engine pads a step of S
                    decode rows (padding tokens write slot 0, padding sequences hold no tokens)
    prefill:SxN     S prompts of N new tokens each, no cached prefix (one step of S * N tokens)
    mixed:SxC+PxN   a mixed step: S decode rows of context C first (the scheduler's order), then P prompts of N new
                    tokens each
    mixed:SxC+PxN@B the same padded to a bucket of B tokens (the sequences are not padded)

What exists here: `StepCase` (`sequences`, `text`), `parse_case`, `case_batch`, `cache_pages`, `sequence_slots` and
`lora_batches` (each sequence one adapter: a prompt's tokens share theirs, decode rows grouped by adapter).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sgl_jax_lora.configs.buckets import pick, segment_buckets
from sgl_jax_lora.lora.lora_batch import build_lora_batch
from sgl_jax_lora.models.forward_batch import ForwardBatch

PAGE_SIZE, RANK = 16, 16
MAX_PREFILL_SEQS = 8  # the engine's default --max-prefill-seqs, which the GPU attention sizes its q-block grid by


class StepCase(NamedTuple):
    kind: str  # decode, prefill or mixed
    seqs: int  # decode rows (decode, mixed) or prompts (prefill)
    length: int  # the decode rows' context, or the prompts' length (prefill)
    bucket: int  # the step's token bucket (decode: its sequences too); prefill: 0, no padding
    prompts: int = 0  # mixed: the prompts after the decode rows ...
    prompt_len: int = 0  # ... and their length

    def sequences(self) -> tuple[list[int], list[int]]:
        """(new tokens, keys after the step) of each real sequence, in the batch's order."""
        if self.kind == "prefill":
            return [self.length] * self.seqs, [self.length] * self.seqs
        prompts = [self.prompt_len] * self.prompts
        return [1] * self.seqs + prompts, [self.length] * self.seqs + prompts

    @property
    def text(self) -> str:
        """The case as `parse_case` reads it, the bucket left out where it pads nothing."""
        shape = f"{self.seqs}x{self.length}" + (f"+{self.prompts}x{self.prompt_len}" if self.kind == "mixed" else "")
        tokens = sum(self.sequences()[0])
        padded = self.bucket not in (0, self.seqs if self.kind == "decode" else tokens)
        return f"{self.kind}:{shape}" + (f"@{self.bucket}" if padded else "")


def parse_case(text: str) -> StepCase:
    """`decode:SxC[@B]`, `prefill:SxN` or `mixed:SxC+PxN[@B]` -> StepCase (a decode or mixed case's bucket: its real
    tokens when not given); SystemExit naming the forms on anything else."""
    kind, _, shape = text.partition(":")
    shape, _, bucket_text = shape.partition("@")
    try:
        parts = [tuple(int(v) for v in part.split("x")) for part in shape.split("+")]
        bucket = int(bucket_text or 0)
    except ValueError:
        parts, bucket = [], 0
    shapes_fit = len(parts) == (2 if kind == "mixed" else 1) and all(len(p) == 2 and min(p) >= 1 for p in parts)
    if kind not in ("decode", "prefill", "mixed") or not shapes_fit:
        raise SystemExit(f"{text}: expected decode:SxC[@B], prefill:SxN or mixed:SxC+PxN[@B] (positive integers)")
    (seqs, length), (prompts, prompt_len) = parts[0], parts[1] if kind == "mixed" else (0, 0)
    case = StepCase(kind, seqs, length, 0, prompts, prompt_len)
    tokens = sum(case.sequences()[0])
    if kind == "prefill" and seqs > MAX_PREFILL_SEQS or prompts > MAX_PREFILL_SEQS:
        raise SystemExit(f"{text}: at most {MAX_PREFILL_SEQS} prompts in a step (the engine's default)")
    if bucket_text and (kind == "prefill" or bucket < (seqs if kind == "decode" else tokens)):
        raise SystemExit(f"{text}: a bucket is for decode and mixed cases, at least their tokens")
    return case._replace(bucket=bucket or (0 if kind == "prefill" else seqs if kind == "decode" else tokens))


def cache_pages(cases: list[StepCase]) -> tuple[int, int]:
    """(pages a sequence's table holds, pages of the KV cache) for these cases: each sequence on pages of its own."""
    pages = [[-(-keys // PAGE_SIZE) for keys in case.sequences()[1]] for case in cases]
    return max(max(p) for p in pages), 1 + max(sum(p) for p in pages)


def case_batch(case: StepCase, max_pages: int, lora) -> tuple[ForwardBatch, list[int], list[int]]:
    """The step's ForwardBatch (each sequence on pages of its own, in order from page 1; a decode case's rows padded
    to its bucket in tokens and sequences, a mixed case's in tokens, as ScheduleBatch.to_forward_batch pads them) ->
    (batch, q_lens, kv_lens) of the real sequences. lora: `lora_batches`' maker, or None."""
    q_lens, kv_lens = case.sequences()
    num_seqs, num_tokens = len(q_lens), sum(q_lens)
    padded = max(case.bucket, num_seqs) if case.kind == "decode" else num_seqs
    pad_tokens = max(case.bucket - num_tokens, 0)
    pages = [-(-keys // PAGE_SIZE) for keys in kv_lens]
    page_table = np.zeros((padded, max_pages), np.int32)
    for seq, first in enumerate(np.cumsum([1] + pages[:-1])):
        page_table[seq, : pages[seq]] = first + np.arange(pages[seq])
    seq = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.concatenate([np.arange(k - q, k) for q, k in zip(q_lens, kv_lens)]).astype(np.int32)
    cache_loc = page_table[seq, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
    cu_q_lens = np.full(padded + 1, num_tokens, np.int32)
    cu_q_lens[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    last_token_index = np.zeros(padded, np.int32)
    last_token_index[:num_seqs] = cu_q_lens[1 : num_seqs + 1] - 1
    ids = np.random.default_rng(0).integers(2, 1000, num_tokens).astype(np.int32)
    batch = ForwardBatch(
        input_ids=np.pad(ids, (0, pad_tokens)),
        positions=np.pad(positions, (0, pad_tokens)),
        cache_loc=np.pad(cache_loc.astype(np.int32), (0, pad_tokens)),
        seq_lens=np.pad(np.array(kv_lens, np.int32), (0, padded - num_seqs)),
        page_table=page_table,
        cu_q_lens=cu_q_lens,
        last_token_index=last_token_index,
        lora=lora(seq, num_seqs, num_tokens + pad_tokens) if lora else None,
        input_from_prev=None,
    )
    return batch, q_lens, kv_lens


def sequence_slots(num_seqs: int, num_adapters: int) -> np.ndarray:
    """[S] adapter slot of each sequence: 1..num_adapters (slot 0 is the base), sequences of one adapter
    consecutive (as the scheduler orders a decode step's rows), as many adapters as there are sequences, at most
    num_adapters, each with the same number of sequences give or take one."""
    return (1 + np.arange(num_seqs) * min(num_adapters, num_seqs) // num_seqs).astype(np.int32)


def lora_batches(num_slots: int):
    """A maker of a step's LoRABatch for adapters in slots 1..num_slots - 1, each of rank RANK and scale 1."""
    scale, rank = np.ones(num_slots, np.float32), np.full(num_slots, RANK, np.int32)
    scale[0] = rank[0] = 0
    buckets = segment_buckets(num_slots)

    def make(token_seq: np.ndarray, num_seqs: int, num_tokens: int):
        """token_seq: [live tokens] the sequence of each real token; the rest of the bucket's num_tokens are padding
        tokens, in the base slot as the engine pads them."""
        token_slot = np.zeros(num_tokens, np.int32)
        token_slot[: len(token_seq)] = sequence_slots(num_seqs, num_slots - 1)[token_seq]
        distinct = len(np.unique(token_slot))
        return build_lora_batch(token_slot, pick(buckets, distinct), scale, rank)

    return make
