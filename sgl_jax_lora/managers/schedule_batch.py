"""ScheduleBatch: the requests the scheduler picked for one step, and their padding into a bucket.

Flow: Scheduler.schedule() -> ScheduleBatch(reqs, num_new_tokens) -> `to_forward_batch` (numpy, padded
to a compiled bucket) and `to_sampling_batch` -> ModelRunner. Pure host code; no device arrays here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from sgl_jax_lora.lora.lora_batch import LoRABatch
from sgl_jax_lora.managers.req import PENDING_TOKEN, Req
from sgl_jax_lora.model_executor.buckets import Buckets, extend_query_layout, pick
from sgl_jax_lora.model_executor.forward_batch import ForwardBatch
from sgl_jax_lora.sampling.sampler import SamplingBatch
from sgl_jax_lora.sampling.sampling_params import MAX_TOP_LOGPROBS

LoRABatchBuilder = Callable[[np.ndarray], LoRABatch | None]  # token slots [T] -> LoRABatch


@dataclasses.dataclass
class ScheduleBatch:
    is_decode: bool
    reqs: list[Req]
    num_new_tokens: list[int]  # tokens each request feeds this step
    token_slots: list[int]  # LoRA device slot of each request (0 = base)

    def padded_sizes(self, buckets: Buckets) -> tuple[int, int, int]:
        """-> (sequences S, tokens T, pages per sequence P) of the bucket this batch runs in."""
        if self.is_decode:
            num_seqs = pick(buckets.decode_seqs, len(self.reqs))
            max_pages = max(len(r.pages) for r in self.reqs)
            return num_seqs, num_seqs, pick(buckets.decode_pages, max_pages)
        num_seqs = pick(buckets.prefill_seqs, len(self.reqs))
        num_tokens = pick(buckets.prefill_tokens, sum(self.num_new_tokens))
        return num_seqs, num_tokens, buckets.max_pages_per_seq

    def to_forward_batch(self, buckets: Buckets, page_size: int, lora_builder: LoRABatchBuilder) -> ForwardBatch:
        if self.is_decode:
            return self._decode_forward_batch(buckets, page_size, lora_builder)
        num_seqs, num_tokens, num_pages = self.padded_sizes(buckets)
        num_rows, tile = extend_query_layout(num_seqs, num_tokens)
        input_ids = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        cache_loc = np.zeros(num_tokens, np.int32)
        token_row = np.zeros(num_tokens, np.int32)
        token_slot = np.zeros(num_tokens, np.int32)
        seq_lens = np.zeros(num_seqs, np.int32)
        page_table = np.zeros((num_seqs, num_pages), np.int32)
        query_seq = np.zeros(num_rows, np.int32)
        query_index = np.zeros((num_rows, tile), np.int32)
        query_valid = np.zeros((num_rows, tile), bool)
        last_token_index = np.zeros(num_seqs, np.int32)
        start, row = 0, 0
        for i, (req, n) in enumerate(zip(self.reqs, self.num_new_tokens)):
            first = req.num_computed
            pos = np.arange(first, first + n, dtype=np.int32)
            pages = np.asarray(req.pages, np.int32)
            span = slice(start, start + n)
            input_ids[span] = req.all_ids[first : first + n]
            positions[span] = pos
            cache_loc[span] = pages[pos // page_size] * page_size + pos % page_size
            token_slot[span] = self.token_slots[i]
            seq_lens[i] = first + n
            page_table[i, : len(pages)] = pages
            k = np.arange(n)  # the sequence's k-th new token sits in row row + k // tile, column k % tile
            token_row[span] = row * tile + k
            query_index[row + k // tile, k % tile] = start + k
            query_valid[row + k // tile, k % tile] = True
            rows = -(-n // tile)
            query_seq[row : row + rows] = i
            last_token_index[i] = start + n - 1
            start, row = start + n, row + rows
        return ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            cache_loc=cache_loc,
            seq_lens=seq_lens,
            page_table=page_table,
            query_seq=query_seq,
            query_index=query_index,
            query_valid=query_valid,
            token_row=token_row,
            last_token_index=last_token_index,
            lora=lora_builder(token_slot),
            is_decode=self.is_decode,
            input_from_prev=np.full(num_tokens, -1, np.int32),  # prefill never feeds a pending token (req.py)
        )

    def _decode_forward_batch(self, buckets: Buckets, page_size: int, lora_builder: LoRABatchBuilder) -> ForwardBatch:
        """Decode layout (one token per sequence, token i = sequence i), built with little per-request Python."""
        num_seqs, _, num_pages = self.padded_sizes(buckets)
        count = len(self.reqs)
        seq_lens = np.zeros(num_seqs, np.int32)
        input_ids = np.zeros(num_seqs, np.int32)
        page_table = np.zeros((num_seqs, num_pages), np.int32)
        input_from_prev = np.full(num_seqs, -1, np.int32)
        for i, req in enumerate(self.reqs):
            seq_lens[i] = req.seq_len
            token = req.output_ids[-1] if req.output_ids else req.input_ids[-1]
            if token == PENDING_TOKEN:  # sampled by the step in flight: read on the device
                input_from_prev[i] = req.pending_row
            else:
                input_ids[i] = token
            page_table[i, : len(req.pages)] = req.pages
        positions = np.maximum(seq_lens - 1, 0)
        rows = np.arange(num_seqs, dtype=np.int32)
        cache_loc = page_table[rows, positions // page_size] * page_size + positions % page_size
        cache_loc[count:] = 0
        token_slot = np.zeros(num_seqs, np.int32)
        token_slot[:count] = self.token_slots
        return ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            cache_loc=cache_loc.astype(np.int32),
            seq_lens=seq_lens,
            page_table=page_table,
            query_seq=rows,
            query_index=rows[:, None],
            query_valid=(rows < count)[:, None],
            token_row=rows,
            last_token_index=rows,
            lora=lora_builder(token_slot),
            is_decode=True,
            input_from_prev=input_from_prev,
        )

    def sampling_reqs(self) -> list[Req]:
        """Requests that sample a token this step: all in decode, those finishing their prefill in extend."""
        if self.is_decode:
            return list(self.reqs)
        return [r for r, n in zip(self.reqs, self.num_new_tokens) if r.num_computed + n == r.seq_len]

    def to_sampling_batch(self, num_seqs: int) -> SamplingBatch:
        """Rows follow self.reqs (padding rows greedy); num_seqs is the padded S."""
        rows = self.reqs
        temperature = np.zeros(num_seqs, np.float32)
        top_p = np.ones(num_seqs, np.float32)
        top_k = np.zeros(num_seqs, np.int32)
        min_p = np.zeros(num_seqs, np.float32)
        seeds = np.zeros(num_seqs, np.uint32)
        steps = np.zeros(num_seqs, np.int32)
        for i, req in enumerate(rows):
            params = req.sampling
            temperature[i] = 0.0 if params.is_greedy else params.temperature
            top_p[i], top_k[i], min_p[i] = params.top_p, max(params.top_k, 0), params.min_p
            seeds[i], steps[i] = req.seed % (2**32), len(req.output_ids)  # a pending token counts: same as without overlap
        needs_top = any(r.return_logprob and r.top_logprobs_num > 0 for r in rows)
        return SamplingBatch(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seeds=seeds,
            steps=steps,
            is_greedy=bool(np.all(temperature == 0)),
            num_top_logprobs=MAX_TOP_LOGPROBS if needs_top else 0,
        )
