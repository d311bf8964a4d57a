"""The warmup: every program of every bucket compiled and run once before the first request (`ModelRunner.warmup`).

Flow: the forward programs, nearly all of the compile time, compile several at once (`precompile_forwards` on
`--warmup-compile-threads` threads), then the KV cache is placed; the sampling programs of each sequence bucket (each
mode of `sampler.sampling_modes`, with top logprobs and without) compile several at once too
(`precompile_sampling`); then each forward runs on a padding batch of its shape, with its prompt logprobs, and the
first of each sequence bucket with its logits (plain and with each logit-adjustment bucket) and its sampling programs,
all found compiled but the small logits and logprob programs. Last, one LoRA slot write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.lora.lora_batch import LoRABatch
from sgl_jax_lora.model_executor.padding_batches import (
    padding_forward_batch,
    padding_sampling_batches,
    warmup_compile_threads,
)
from sgl_jax_lora.sampling.logit_adjustments import padding_logit_adjustments
from sgl_jax_lora.sampling.sampling_params import MAX_TOP_LOGPROBS

if TYPE_CHECKING:  # model_runner.py imports this module
    from sgl_jax_lora.model_executor.model_runner import ModelRunner


def warm_up(
    runner: ModelRunner, buckets: Buckets, lora_for: Callable[[int], list[LoRABatch | None]], progress: Callable
) -> None:
    """Compile every bucket of `runner`, then run each once on padding (no tokens, cache slot 0).

    lora_for(T) gives one padding LoRABatch per LoRA segment bucket ([None] without LoRA). The programs of steps of
    decode rows alone (Buckets.programs) compile and run as the others; the logits, sampling and prompt logprobs
    programs, which they share, with the first."""
    programs = [(s, t, d, i) for s, t, d in buckets.programs() for i in range(len(lora_for(t)))]
    pages = buckets.max_pages_per_seq
    batches = [padding_forward_batch(s, t, pages, lora_for(t)[i], d) for s, t, d, i in programs]
    threads = warmup_compile_threads(runner.args.warmup_compile_threads)
    adjusted = sum(len(buckets.logit_entry_sizes(s)) for s in buckets.sample_sizes())
    sampled = 2 * len(runner.sampling_modes) * len(buckets.sample_sizes())  # each mode with top logprobs or not
    total = 2 * len(programs) + sampled + 2 * len(buckets.tokens) + adjusted
    bar = progress(total=total, desc="compiling buckets")
    runner.precompile_forwards(batches, threads, on_done=lambda: bar.update(1))
    runner.place_kv_cache()  # after the forwards compiled: their autotuning had the cache's memory
    first_of_bucket = {}  # sequence bucket -> the first forward batch of that many sequences (LoRA segments first)
    for (num_seqs, _, decode_only, lora_index), batch in zip(programs, batches):
        if lora_index == 0 and not decode_only:
            first_of_bucket.setdefault(num_seqs, batch)
    runner.precompile_sampling(list(first_of_bucket.values()), threads)
    for (num_seqs, num_tokens, decode_only, lora_index), batch in zip(programs, batches):
        hidden, last_hidden = runner.forward(batch)
        if lora_index == 0 and not decode_only:
            for num_top in (0, MAX_TOP_LOGPROBS):
                runner.prompt_logprobs(hidden, np.zeros((num_tokens,), np.int32), num_top)
                bar.update(1)
            if first_of_bucket.get(num_seqs) is batch:
                for sampling in padding_sampling_batches(num_seqs, runner.sampling_modes):
                    runner.sample(last_hidden, sampling)
                    bar.update(1)
                for num_entries in buckets.logit_entry_sizes(num_seqs):  # the logits with adjustments
                    adjustments = padding_logit_adjustments(num_seqs, num_entries)
                    runner.logits(last_hidden, adjustments).block_until_ready()
                    bar.update(1)
        bar.update(1)
    shapes_of_lora = runner.lora_buffer_shapes()
    if shapes_of_lora:  # slot 0 stays all zeros: this compiles the slot write once
        zeros = {p: np.zeros((s[0],) + s[2:], np.float32) for p, s in shapes_of_lora.items()}
        runner.write_lora_slot(0, runner.lora_slot_values(zeros))
    bar.close()
