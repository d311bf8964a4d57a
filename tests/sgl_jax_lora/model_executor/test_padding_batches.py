"""sgl_jax_lora/model_executor/padding_batches.py: a padding step has the bucket's shapes and touches nothing real
(every token writes the scratch slot 0, no sequence has keys, no token reads an in-flight token); a padding sampling
batch is greedy or not as asked, and a bucket's padding sampling batches cover every program of its modes; the compile-thread count follows the CPU count, at most 8."""

from __future__ import annotations

import os

import numpy as np

from sgl_jax_lora.lora.lora_batch import build_lora_batch
from sgl_jax_lora.model_executor.padding_batches import (
    padding_forward_batch,
    padding_sampling_batch,
    padding_sampling_batches,
    warmup_compile_threads,
)
from sgl_jax_lora.sampling.sampling_params import MAX_TOP_LOGPROBS


def test_a_padding_step_has_the_bucket_shape_and_writes_only_the_scratch_slot():
    batch = padding_forward_batch(4, 16, 3, None)
    assert batch.input_ids.shape == batch.positions.shape == batch.cache_loc.shape == (16,)
    assert batch.seq_lens.shape == batch.last_token_index.shape == (4,)
    assert batch.page_table.shape == (4, 3) and batch.cu_q_lens.shape == (5,)
    assert not batch.cache_loc.any() and not batch.seq_lens.any() and not batch.cu_q_lens.any()
    assert (batch.input_from_prev == -1).all()  # no token takes the previous step's sampled token
    assert batch.lora is None
    lora = build_lora_batch(np.zeros(16, np.int32), 2, np.zeros(3, np.float32), np.zeros(3, np.int32))
    assert padding_forward_batch(4, 16, 3, lora).lora is lora


def test_a_padding_sampling_batch_is_greedy_or_not_as_asked():
    greedy = padding_sampling_batch(8, True, 0)
    assert greedy.is_greedy and greedy.num_top_logprobs == 0
    assert greedy.temperature.shape == greedy.top_p.shape == greedy.seeds.shape == (8,)
    sampled = padding_sampling_batch(8, False, 5)
    assert not sampled.is_greedy and sampled.num_top_logprobs == 5
    assert (sampled.top_p == 1).all() and not sampled.top_k.any()  # no filter
    assert not sampled.filters and padding_sampling_batch(8, False, 0, filters=True).filters  # the search's program


def test_a_buckets_padding_sampling_batches_cover_each_mode_with_and_without_top_logprobs():
    modes = ((True, False), (False, False), (False, True))
    batches = padding_sampling_batches(8, modes)
    variants = [(b.is_greedy, b.filters, b.num_top_logprobs) for b in batches]
    assert variants == [(g, f, top) for g, f in modes for top in (0, MAX_TOP_LOGPROBS)]
    assert all(b.seeds.shape == (8,) for b in batches)


def test_compile_threads_follow_the_cpu_count_up_to_8(monkeypatch):
    assert warmup_compile_threads(3) == 3  # what the flag asks
    for cores, expected in ((1, 1), (2, 2), (16, 8), (None, 1)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert warmup_compile_threads(0) == expected
