"""The sampler's filters against a sort-based numpy reference, and its draws against the filtered distribution.

The sampler finds each row's probability threshold by bisection (no sort of the vocabulary); the reference sorts
each row descending and keeps a token while fewer than top_k come before it, the mass before it is below top_p,
and its probability is at least min_p times the largest, the rules as the OpenAI and HF samplers state them
(top_p 1 keeps every token).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.sampling.sampler import SamplingBatch, filter_mask, sample


def reference_mask(scaled: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    keep = np.zeros_like(probs, dtype=bool)
    for s, row in enumerate(probs):
        order = np.argsort(-row, kind="stable")
        before = np.cumsum(row[order]) - row[order]
        rank = np.arange(row.size)
        kept = (rank < (top_k[s] if top_k[s] > 0 else row.size)) & ((before < top_p[s]) | (top_p[s] >= 1)) & (row[order] >= min_p[s] * row.max())
        keep[s, order[kept]] = True
    return keep


def batch_of(top_k, top_p, min_p, temperature=1.0) -> SamplingBatch:
    rows = len(top_k)
    return SamplingBatch(temperature=jnp.full((rows,), temperature, jnp.float32), top_p=jnp.asarray(top_p, jnp.float32),
                         top_k=jnp.asarray(top_k, jnp.int32), min_p=jnp.asarray(min_p, jnp.float32),
                         seeds=jnp.arange(rows, dtype=jnp.uint32), steps=jnp.zeros((rows,), jnp.int32),
                         is_greedy=False, num_top_logprobs=0)


@pytest.mark.parametrize("vocab", [7, 491, 32000])
def test_filters_match_a_sort(vocab):
    rng = np.random.default_rng(vocab)
    top_k = [0, 1, 5, 0, 0, 3, vocab, 40]
    top_p = [1.0, 1.0, 1.0, 0.9, 0.5, 0.3, 0.99, 0.8]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.02]
    scaled = (rng.standard_normal((len(top_k), vocab)) * rng.uniform(0.5, 4, (len(top_k), 1))).astype(np.float32)
    got = np.asarray(filter_mask(jnp.asarray(scaled), batch_of(top_k, top_p, min_p)))
    want = reference_mask(scaled, np.array(top_k), np.array(top_p, np.float32), np.array(min_p, np.float32))
    np.testing.assert_array_equal(got, want)


def test_no_filter_keeps_every_token():
    scaled = np.random.default_rng(1).standard_normal((3, 100)).astype(np.float32)
    assert np.asarray(filter_mask(jnp.asarray(scaled), batch_of([0] * 3, [1.0] * 3, [0.0] * 3))).all()


def test_draws_stay_in_the_kept_set_and_follow_its_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000, np.float32))
    batch = batch_of([0] * 4000, [0.7] * 4000, [0.0] * 4000)  # nucleus: the first two tokens
    batch = SamplingBatch(**{**batch.__dict__, "seeds": jnp.arange(4000, dtype=jnp.uint32)})
    ids = np.asarray(sample(jnp.asarray(logits), batch).next_ids)
    assert set(ids.tolist()) == {0, 1}
    assert abs((ids == 0).mean() - 0.5 / 0.8) < 0.03  # 0.625 within ~4 standard deviations of 4000 draws
