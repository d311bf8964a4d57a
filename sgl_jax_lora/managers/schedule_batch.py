"""ScheduleBatch: the plan of one ragged step (the requests the scheduler picked, the adapters it put in device
slots) and its padding into a bucket.

Flow: Scheduler.schedule() -> ScheduleBatch(reqs, num_new_tokens, token_slots, adapters): decode rows (one token
each) then prefill chunks; `adapters` (AdapterPlan) holds the slot writes the step needs, which EngineCore applies
(LoRAManager.apply) before launching it -> `to_forward_batch` (numpy, padded to a compiled token bucket) and
`to_sampling_batch` -> ModelRunner. Pure host code; no device arrays here.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np

from sgl_jax_lora.configs.buckets import Buckets, pick
from sgl_jax_lora.lora.adapter_plan import AdapterPlan, SlotWrite
from sgl_jax_lora.lora.lora_batch import LoRABatch
from sgl_jax_lora.managers.in_flight import InFlightTokens
from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.models.forward_batch import ForwardBatch
from sgl_jax_lora.sampling.sampler import SamplingBatch
from sgl_jax_lora.sampling.sampling_params import MAX_TOP_LOGPROBS

LoRABatchBuilder = Callable[[np.ndarray], LoRABatch | None]  # token slots [T] -> LoRABatch


@dataclasses.dataclass
class ScheduleBatch:
    reqs: list[Req]  # decode rows first, then prefill chunks
    num_new_tokens: list[int]  # tokens each request feeds this step (1 for a decode row)
    token_slots: list[int]  # LoRA device slot of each request (0 = base)
    num_decode_rows: int = 0  # the first num_decode_rows requests feed their last sampled token
    adapters: AdapterPlan = dataclasses.field(default_factory=AdapterPlan)

    @property
    def slot_writes(self) -> list[SlotWrite]:
        """The adapter loads to apply to the device before this step runs."""
        return self.adapters.slot_writes

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def kind(self) -> str:
        """'decode' (decode rows only), 'extend' (prefill chunks only) or 'mixed'."""
        if self.num_decode_rows == len(self.reqs):
            return "decode"
        return "mixed" if self.num_decode_rows else "extend"

    def group_rows_by_slot(self) -> None:
        """Order the rows by adapter slot, the given order within a slot (the scheduler calls this on the decode
        rows, before any chunk joins). Each adapter's decode rows are then one run of tokens. The GEMM with the
        LoRA inside it (mixed steps on Hopper GPUs) adds a row tile's LoRA run by run, one after another; with
        adapters interleaved, nearly every decode row would be a run of its own."""
        order = sorted(range(len(self.reqs)), key=self.token_slots.__getitem__)
        self.reqs[:] = [self.reqs[i] for i in order]
        self.num_new_tokens[:] = [self.num_new_tokens[i] for i in order]
        self.token_slots[:] = [self.token_slots[i] for i in order]

    def padded_sizes(self, buckets: Buckets) -> tuple[int, int]:
        """-> (sequences S, tokens T) of the bucket this step runs in."""
        num_tokens = pick(buckets.tokens, self.num_tokens)
        return buckets.seqs_for(num_tokens), num_tokens

    def to_forward_batch(
        self,
        buckets: Buckets,
        page_size: int,
        lora_builder: LoRABatchBuilder,
        in_flight: InFlightTokens | None = None,
    ) -> ForwardBatch:
        """The step padded to its bucket: the ragged layout (cu_q_lens), token ids (or, for a decode row whose token
        the step in flight samples, its row in that step's ids, from `in_flight`; None: no token is in flight),
        positions, cache slots, page tables; a step whose every sequence feeds one token runs its bucket's program
        for decode rows alone where the buckets have such programs."""
        num_seqs, num_tokens = self.padded_sizes(buckets)
        count, total = len(self.reqs), self.num_tokens
        q_lens = np.asarray(self.num_new_tokens, np.int32)
        cu_q_lens = np.full(num_seqs + 1, total, np.int32)
        cu_q_lens[0] = 0
        cu_q_lens[1 : count + 1] = np.cumsum(q_lens)
        first = np.fromiter((r.num_computed for r in self.reqs), np.int32, count)
        seq_lens = np.zeros(num_seqs, np.int32)
        seq_lens[:count] = first + q_lens
        page_table = _page_table(self.reqs, num_seqs, buckets.max_pages_per_seq)
        input_ids, input_from_prev = self._token_inputs(num_tokens, cu_q_lens.tolist(), in_flight)
        seq_of_token = np.repeat(np.arange(count, dtype=np.int32), q_lens)
        positions = np.zeros(num_tokens, np.int32)
        positions[:total] = first[seq_of_token] + np.arange(total, dtype=np.int32) - cu_q_lens[seq_of_token]
        cache_loc = np.zeros(num_tokens, np.int32)
        cache_loc[:total] = (
            page_table[seq_of_token, positions[:total] // page_size] * page_size + positions[:total] % page_size
        )
        token_slot = np.zeros(num_tokens, np.int32)
        token_slot[:total] = np.repeat(np.asarray(self.token_slots, np.int32), q_lens)
        last_token_index = np.zeros(num_seqs, np.int32)
        last_token_index[:count] = cu_q_lens[1 : count + 1] - 1
        return ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            cache_loc=cache_loc,
            seq_lens=seq_lens,
            page_table=page_table,
            cu_q_lens=cu_q_lens,
            last_token_index=last_token_index,
            lora=lora_builder(token_slot),
            input_from_prev=input_from_prev,
            decode_only=buckets.decode_programs and count > 0 and int(q_lens.max()) == 1,
        )

    def _token_inputs(
        self, num_tokens: int, starts: list[int], in_flight: InFlightTokens | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """-> (input_ids, input_from_prev) [T]: each chunk's prompt ids, each decode row's last sampled id, or, for a
        token still in flight, its row in the previous step's sampled ids (-1 elsewhere). Runs per request in every
        step, so its Python-level work is kept to the minimum: single tokens are written at once at the end."""
        input_ids = np.zeros(num_tokens, np.int32)
        input_from_prev = np.full(num_tokens, -1, np.int32)
        fed_at, fed_ids, from_prev_at, from_prev_rows = [], [], [], []
        for i, req in enumerate(self.reqs):
            start, n, computed = starts[i], self.num_new_tokens[i], req.num_computed
            num_output = len(req.output_ids) + req.num_in_flight
            if num_output and computed == len(req.input_ids) + num_output - 1:  # feeds its last sampled token
                if req.num_in_flight:  # sampled by the step in flight: read on the device
                    row = in_flight.row(req) if in_flight is not None else -1
                    if row < 0:
                        raise ValueError(f"request {req.rid} has a token in flight that no InFlightTokens records")
                    from_prev_at.append(start)
                    from_prev_rows.append(row)
                else:
                    fed_at.append(start)
                    fed_ids.append(req.output_ids[-1])
            else:  # a prefill chunk never reaches a token in flight (req.py)
                input_ids[start : start + n] = req.all_ids[computed : computed + n]
        input_ids[fed_at] = fed_ids
        input_from_prev[from_prev_at] = from_prev_rows
        return input_ids, input_from_prev

    def sampling_reqs(self) -> list[Req]:
        """Requests that sample a token this step: decode rows, and chunks that finish their prefill."""
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
        count, params = len(rows), [r.sampling for r in rows]  # column by column: one numpy write each
        temperature[:count] = [0.0 if p.is_greedy else p.temperature for p in params]
        top_p[:count] = [p.top_p for p in params]
        top_k[:count] = [max(p.top_k, 0) for p in params]
        min_p[:count] = [p.min_p for p in params]
        seeds[:count] = [r.seed % (2**32) for r in rows]
        # a token in flight counts (Req.num_output_tokens), as without the overlap schedule
        steps[:count] = [len(r.output_ids) + r.num_in_flight for r in rows]
        needs_top = any(r.return_logprob and r.top_logprobs_num > 0 for r in rows)
        sampled = temperature > 0
        filters = (top_k > 0) | (top_p < 1) | (min_p > 0)  # (a top_k of the vocabulary or more keeps every token)
        return SamplingBatch(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seeds=seeds,
            steps=steps,
            is_greedy=not sampled.any(),
            num_top_logprobs=MAX_TOP_LOGPROBS if needs_top else 0,
            filters=bool((sampled & filters).any()),
        )


def _page_table(reqs: list[Req], num_seqs: int, max_pages: int) -> np.ndarray:
    """[num_seqs, max_pages] page ids, row i holding reqs[i].pages then zeros; filled in one write (a row-major
    mask over the rows' lengths takes the concatenated pages in order)."""
    page_table = np.zeros((num_seqs, max_pages), np.int32)
    lengths = np.fromiter((len(r.pages) for r in reqs), np.int64, len(reqs))
    if lengths.size and lengths.max() > max_pages:
        raise ValueError(f"a request holds {int(lengths.max())} KV pages, more than a page table row's {max_pages}")
    held = np.arange(max_pages) < lengths[:, None]
    page_table[: len(reqs)][held] = np.fromiter(itertools.chain.from_iterable(r.pages for r in reqs), np.int32)
    return page_table
