"""Padding batches: steps of a bucket's shape with no real token, which the warmup runs to compile and run every
program once (ModelRunner.warmup), and the compile-thread count it uses.

A padding forward writes only the scratch KV page 0 and attends to nothing; a padding sampling batch is greedy or
not and asks for top logprobs or not, the variants a step can compile.
"""

from __future__ import annotations

import os

import numpy as np

from sgl_jax_lora.lora.lora_batch import LoRABatch
from sgl_jax_lora.models.forward_batch import ForwardBatch
from sgl_jax_lora.sampling.sampler import SamplingBatch
from sgl_jax_lora.sampling.sampling_params import MAX_TOP_LOGPROBS


def padding_forward_batch(
    num_seqs: int, num_tokens: int, num_pages: int, lora: LoRABatch | None, decode_only: bool = False
) -> ForwardBatch:
    """A step of the (S, T) bucket with no real token: every token writes scratch slot 0, no sequence has keys.
    decode_only: the bucket's program for steps of decode rows alone (Buckets.programs)."""
    zeros_i = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return ForwardBatch(
        input_ids=zeros_i(num_tokens),
        positions=zeros_i(num_tokens),
        cache_loc=zeros_i(num_tokens),
        seq_lens=zeros_i(num_seqs),
        page_table=zeros_i(num_seqs, num_pages),
        cu_q_lens=zeros_i(num_seqs + 1),
        last_token_index=zeros_i(num_seqs),
        lora=lora,
        input_from_prev=np.full((num_tokens,), -1, np.int32),
        decode_only=decode_only,
    )


def warmup_compile_threads(requested: int) -> int:
    """--warmup-compile-threads: 0 picks one thread per CPU core, at most 8 (each compile holds its program's
    HLO and XLA's working memory on the host)."""
    return requested if requested > 0 else max(1, min(8, os.cpu_count() or 1))


def padding_sampling_batch(num_seqs: int, is_greedy: bool, num_top: int, filters: bool | None = False) -> SamplingBatch:
    """A batch of num_seqs padding rows that compiles (and runs) the sampling program of its mode (`sampling_modes`)."""
    return SamplingBatch(
        temperature=np.zeros((num_seqs,), np.float32),
        top_p=np.ones((num_seqs,), np.float32),
        top_k=np.zeros((num_seqs,), np.int32),
        min_p=np.zeros((num_seqs,), np.float32),
        seeds=np.zeros((num_seqs,), np.uint32),
        steps=np.zeros((num_seqs,), np.int32),
        is_greedy=is_greedy,
        num_top_logprobs=num_top,
        filters=filters,
    )


def padding_sampling_batches(num_seqs: int, modes: tuple[tuple[bool, bool | None], ...]) -> list[SamplingBatch]:
    """The padding batches of every sampling program of a bucket of num_seqs sequences: each (is_greedy, filters) of
    `modes` (`sampler.sampling_modes`), without top logprobs and with them."""
    return [
        padding_sampling_batch(num_seqs, greedy, num_top, filters)
        for greedy, filters in modes
        for num_top in (0, MAX_TOP_LOGPROBS)
    ]
