"""Paged attention against a direct per-token reference, on the batches the scheduler really builds.

The extend step lays its queries out in rows of tokens of one sequence (buckets.extend_query_layout);
these cases put sequences across row boundaries, after a cached prefix, and beside one-token chunks, so a token
that lands in the wrong row or reads another sequence's keys changes the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.layers.attention import paged_attention
from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.managers.schedule_batch import ScheduleBatch
from sgl_jax_lora.model_executor.buckets import EXTEND_QUERY_TILE, Buckets
from sgl_jax_lora.sampling.sampling_params import SamplingParams

PAGE, HEADS, KV_HEADS, DIM = 4, 4, 2, 8
NUM_PAGES = 400


@pytest.fixture(autouse=True)
def full_precision_matmuls():
    """f32 products at full precision on every platform (GPUs default to TF32), so 1e-5 holds."""
    with jax.default_matmul_precision("highest"):
        yield


def make_reqs(spans: list[tuple[int, int]], rng: np.random.Generator) -> list[Req]:
    """One request per (cached prefix, new tokens), holding shuffled pages for prefix + new."""
    free = list(rng.permutation(np.arange(1, NUM_PAGES)))
    reqs = []
    for i, (prefix, new) in enumerate(spans):
        ids = list(range(2, 2 + prefix + new))
        req = Req(rid=f"r{i}", input_ids=ids, sampling=SamplingParams(max_new_tokens=1), seed=0)
        req.num_computed = prefix
        req.pages = [int(free.pop()) for _ in range(-(-(prefix + new) // PAGE))]
        reqs.append(req)
    return reqs


def run_attention(fb, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Random q and caches for this batch -> (q, k_cache, v_cache, paged_attention's output)."""
    k_cache = rng.standard_normal((KV_HEADS, NUM_PAGES * PAGE, DIM)).astype(np.float32)
    v_cache = rng.standard_normal((KV_HEADS, NUM_PAGES * PAGE, DIM)).astype(np.float32)
    q = rng.standard_normal((fb.num_tokens, HEADS, DIM)).astype(np.float32)
    # the caches of every layer go in whole; layer 1 is read, layer 0 holds other values
    k_stack, v_stack = (jnp.asarray(np.stack([-c, c])) for c in (k_cache, v_cache))
    got = paged_attention(jnp.asarray(q), k_stack, v_stack, jnp.int32(1), fb, PAGE, DIM**-0.5)
    return q, k_cache, v_cache, np.asarray(got)


def reference(q, k_cache, v_cache, reqs, new_tokens) -> np.ndarray:
    """Each new token attends to its own sequence's keys at positions <= its own, read slot by slot."""
    out, row = np.zeros_like(q), 0
    group = HEADS // KV_HEADS
    for req, n in zip(reqs, new_tokens):
        for pos in range(req.num_computed, req.num_computed + n):
            slots = [req.pages[p // PAGE] * PAGE + p % PAGE for p in range(pos + 1)]
            for h in range(HEADS):
                keys, values = k_cache[h // group, slots], v_cache[h // group, slots]
                scores = keys @ q[row, h] / np.sqrt(DIM)
                probs = np.exp(scores - scores.max())
                out[row, h] = probs / probs.sum() @ values
            row += 1
    return out[:row]


@pytest.mark.parametrize(
    "spans",
    [
        [(0, 5), (3, 130), (0, EXTEND_QUERY_TILE), (200, 1)],  # crosses a row boundary, fills one row exactly
        [(0, 300)],  # one sequence: a single row
        [(0, 300), (10, 100)],  # two sequences: rows of 256, the first over two
        [(17, 1), (0, 1), (5, 2)],  # tokens fewer than a tile
    ],
)
def test_extend_rows_match_reference(spans):
    rng = np.random.default_rng(0)
    reqs = make_reqs(spans, rng)
    new_tokens = [n for _, n in spans]
    buckets = Buckets.build(8, 512, 4, 1024, PAGE)
    batch = ScheduleBatch(is_decode=False, reqs=reqs, num_new_tokens=new_tokens, token_slots=[0] * len(reqs))
    fb = batch.to_forward_batch(buckets, PAGE, lambda slots: None)
    q, k_cache, v_cache, got = run_attention(fb, rng)

    real = sum(new_tokens)
    np.testing.assert_allclose(got[:real], reference(q, k_cache, v_cache, reqs, new_tokens), rtol=1e-5, atol=1e-5)
    assert fb.query_index.shape[1] == min(fb.num_tokens, max(EXTEND_QUERY_TILE, fb.num_tokens // fb.num_seqs))


def test_decode_matches_reference():
    rng = np.random.default_rng(1)
    reqs = make_reqs([(9, 1), (1, 1), (130, 1)], rng)
    for req in reqs:  # decode: the last input token is this step's token
        req.num_computed = req.seq_len - 1
    buckets = Buckets.build(8, 512, 4, 1024, PAGE)
    batch = ScheduleBatch(is_decode=True, reqs=reqs, num_new_tokens=[1] * 3, token_slots=[0] * 3)
    fb = batch.to_forward_batch(buckets, PAGE, lambda slots: None)
    q, k_cache, v_cache, got = run_attention(fb, rng)

    np.testing.assert_allclose(got[:3], reference(q, k_cache, v_cache, reqs, [1] * 3), rtol=1e-5, atol=1e-5)
