"""The sampler's GPU programs on a CUDA GPU (marked `gpu`, run with `-m gpu`): each mode the engine compiles there
(`GPU_SAMPLING_MODES`), at a Llama-3 vocabulary (128,256 tokens, 1,002 blocks of the draw in 32 groups), against the
sort-based reference of test_sampler.py and the weights' own distribution. On the CPU the same functions are tested
in test_sampler.py; the GPU lowers them differently (its draw's running sums are masked reductions, its threshold
search unrolled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.sampling import sampler
from sgl_jax_lora.sampling.sampler import SamplingBatch, draw, filter_mask, sample
from sgl_jax_lora.sampling.sampling_params import MAX_TOP_LOGPROBS
from tests.sgl_jax_lora.sampling.test_sampler import reference_mask

ON_GPU = jax.devices()[0].platform == "gpu"
VOCAB = 128256

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")]


def gpu_batch(rows: int, temperature, top_p, top_k, min_p, num_top: int = 0) -> SamplingBatch:
    top_p, top_k, min_p = (np.resize(np.asarray(v), rows) for v in (top_p, top_k, min_p))
    temperature = np.resize(np.asarray(temperature, np.float32), rows)
    sampled = temperature > 0
    return SamplingBatch(
        temperature=jnp.asarray(temperature),
        top_p=jnp.asarray(top_p, jnp.float32),
        top_k=jnp.asarray(top_k, jnp.int32),
        min_p=jnp.asarray(min_p, jnp.float32),
        seeds=jnp.arange(rows, dtype=jnp.uint32),
        steps=jnp.full((rows,), 5, jnp.int32),
        is_greedy=not sampled.any(),
        num_top_logprobs=num_top,
        # as the host chooses on a GPU (ScheduleBatch): the search runs when a sampled row filters
        filters=bool((sampled & ((top_k > 0) | (top_p < 1) | (min_p > 0))).any()),
    )


def llama_like_logits(rows: int, seed: int) -> np.ndarray:
    """[rows, VOCAB] float32 logits with a heavy head and a long tail, as a language model's are."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, VOCAB)).astype(np.float32) * 2
    head = rng.integers(0, VOCAB, (rows, 40))
    np.put_along_axis(logits, head, rng.uniform(8, 14, (rows, 40)).astype(np.float32), axis=-1)
    return logits


@pytest.mark.parametrize("rows", [64, 256])
def test_filters_match_a_sort_at_a_full_vocabulary(rows):
    logits = llama_like_logits(rows, rows)
    top_k = [0, 1, 20, 0, 0, 50, 0, 1000]
    top_p = [1.0, 1.0, 1.0, 0.9, 0.5, 0.95, 0.99, 0.8]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.0]
    batch = gpu_batch(rows, 1.0, top_p, top_k, min_p)
    got = np.asarray(jax.jit(filter_mask)(jnp.asarray(logits), batch))
    # the GPU's softmax and sums round differently from numpy's: a token whose mass before it lies within 1e-5 of
    # top_p (or whose probability within 1e-5 of min_p times the largest) may fall either way
    top_k, top_p, min_p = (np.asarray(v) for v in (batch.top_k, batch.top_p, batch.min_p))
    widen = lambda values, active, by: np.where(active, values + by, values).astype(np.float32)  # noqa: E731
    surely_kept = reference_mask(logits, top_k, widen(top_p, top_p < 1, -1e-5), widen(min_p, min_p > 0, 1e-5))
    maybe_kept = reference_mask(logits, top_k, widen(top_p, top_p < 1, 1e-5), widen(min_p, min_p > 0, -1e-5))
    assert (got >= surely_kept).all() and (got <= maybe_kept).all()
    assert (surely_kept != maybe_kept).sum() <= rows  # the margin is narrow: about a token a row at most


@pytest.mark.parametrize("num_top", [0, MAX_TOP_LOGPROBS])
@pytest.mark.parametrize("greedy, filters", sampler.GPU_SAMPLING_MODES)
def test_each_gpu_program_takes_argmax_or_a_kept_token(greedy, filters, num_top):
    rows = 256
    logits = llama_like_logits(rows, 7)
    temperature = 0.0 if greedy else [0.0, 0.7, 1.0, 1.3]  # greedy rows beside sampled ones
    top_p = 0.9 if filters else 1.0
    batch = gpu_batch(rows, temperature, top_p, 0, 0.0, num_top)
    assert (batch.is_greedy, batch.filters) == (greedy, filters)
    out = jax.jit(sample)(jnp.asarray(logits), batch)
    ids = np.asarray(out.next_ids)
    temps = np.asarray(batch.temperature)
    np.testing.assert_array_equal(ids[temps == 0], logits[temps == 0].argmax(-1))
    scaled = logits / np.maximum(temps, 1e-6)[:, None]
    kept = reference_mask(scaled, np.zeros(rows, int), np.asarray(batch.top_p), np.zeros(rows, np.float32))
    assert kept[np.arange(rows), ids].all()
    log_softmax = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(np.asarray(out.next_logprobs), log_softmax[np.arange(rows), ids], atol=1e-4)
    assert out.top_ids.shape == (rows, num_top)
    if num_top:
        np.testing.assert_array_equal(np.asarray(out.top_ids)[:, 0], logits.argmax(-1))


@pytest.mark.parametrize("loops", [False, True])
def test_draw_follows_the_weights_over_every_group(loops):
    # 8 draws of 1,024 rows (the engine's most sampled rows), not one of 8,192: XLA's autotuner took 36.5 s to
    # compile the masked draw at 4,096 rows on an H200 and had not finished at 8,192 after 70 s (2.7 s at 1,024)
    rows, calls = 1024, 8
    weights = np.zeros(VOCAB, np.float32)
    positive = np.array([0, 127, 128, 4095, 4096, 70001, VOCAB - 129, VOCAB - 1])  # block and group edges
    weights[positive] = [0.05, 0.1, 0.15, 0.2, 0.05, 0.25, 0.1, 0.1]
    tiled = jnp.tile(jnp.asarray(weights), (rows, 1))
    drawn = jax.jit(draw, static_argnames="loops")
    seeds = jnp.arange(rows * calls, dtype=jnp.uint32).reshape(calls, rows)
    ids = np.concatenate([np.asarray(drawn(jax.vmap(jax.random.key)(seed), tiled, loops)) for seed in seeds])
    assert set(ids.tolist()) <= set(positive.tolist())
    for index in positive:
        share = weights[index] / weights.sum()
        assert abs((ids == index).mean() - share) < 5 * np.sqrt(share * (1 - share) / ids.size)


def test_a_rows_token_depends_on_its_seed_and_step_alone():
    logits = llama_like_logits(64, 3)
    batch = gpu_batch(64, 1.0, 0.95, 0, 0.0)
    alone = np.asarray(jax.jit(sample)(jnp.asarray(logits[:8]), gpu_batch(8, 1.0, 0.95, 0, 0.0)).next_ids)
    together = np.asarray(jax.jit(sample)(jnp.asarray(logits), batch).next_ids)
    np.testing.assert_array_equal(alone, together[:8])
