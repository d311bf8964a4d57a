"""The sampler's filters against a sort-based numpy reference, and its draws against the filtered distribution.

The sampler finds each row's probability threshold by bisection (no sort of the vocabulary); the reference sorts
each row descending and keeps a token while fewer than top_k come before it, the mass before it is below top_p,
and its probability is at least min_p times the largest, the rules as the OpenAI and HF samplers state them
(top_p 1 keeps every token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.sampling import sampler
from sgl_jax_lora.sampling.sampler import (
    SamplingBatch,
    chunked_token_logprobs,
    draw,
    filter_mask,
    sample,
    token_logprobs,
)


def reference_mask(scaled: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    keep = np.zeros_like(probs, dtype=bool)
    for s, row in enumerate(probs):
        order = np.argsort(-row, kind="stable")
        before = np.cumsum(row[order]) - row[order]
        rank = np.arange(row.size)
        kept = (
            (rank < (top_k[s] if top_k[s] > 0 else row.size))
            & ((before < top_p[s]) | (top_p[s] >= 1))
            & (row[order] >= min_p[s] * row.max())
        )
        keep[s, order[kept]] = True
    return keep


def batch_of(top_k, top_p, min_p, temperature=1.0, host_chooses=True) -> SamplingBatch:
    """host_chooses: whether the filter search runs is chosen on the host (as on a GPU), else on the device."""
    rows = len(top_k)
    filters = any(k > 0 for k in top_k) or any(p < 1 for p in top_p) or any(m > 0 for m in min_p)
    return SamplingBatch(
        temperature=jnp.full((rows,), temperature, jnp.float32),
        top_p=jnp.asarray(top_p, jnp.float32),
        top_k=jnp.asarray(top_k, jnp.int32),
        min_p=jnp.asarray(min_p, jnp.float32),
        seeds=jnp.arange(rows, dtype=jnp.uint32),
        steps=jnp.zeros((rows,), jnp.int32),
        is_greedy=False,
        num_top_logprobs=0,
        filters=filters if host_chooses else None,
    )


@pytest.mark.parametrize("host_chooses", [True, False])
@pytest.mark.parametrize("vocab", [7, 491, 32000])
def test_filters_match_a_sort(vocab, host_chooses):
    rng = np.random.default_rng(vocab)
    top_k = [0, 1, 5, 0, 0, 3, vocab, 40]
    top_p = [1.0, 1.0, 1.0, 0.9, 0.5, 0.3, 0.99, 0.8]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.02]
    scaled = (rng.standard_normal((len(top_k), vocab)) * rng.uniform(0.5, 4, (len(top_k), 1))).astype(np.float32)
    got = np.asarray(filter_mask(jnp.asarray(scaled), batch_of(top_k, top_p, min_p, host_chooses=host_chooses)))
    want = reference_mask(scaled, np.array(top_k), np.array(top_p, np.float32), np.array(min_p, np.float32))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("host_chooses", [True, False])
def test_no_filter_keeps_every_token(host_chooses):
    scaled = np.random.default_rng(1).standard_normal((3, 100)).astype(np.float32)
    batch = batch_of([0] * 3, [1.0] * 3, [0.0] * 3, host_chooses=host_chooses)
    assert np.asarray(filter_mask(jnp.asarray(scaled), batch)).all()


def test_draws_stay_in_the_kept_set_and_follow_its_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000, np.float32))
    batch = batch_of([0] * 4000, [0.7] * 4000, [0.0] * 4000)  # nucleus: the first two tokens
    batch = SamplingBatch(**{**batch.__dict__, "seeds": jnp.arange(4000, dtype=jnp.uint32)})
    ids = np.asarray(sample(jnp.asarray(logits), batch).next_ids)
    assert set(ids.tolist()) == {0, 1}
    assert abs((ids == 0).mean() - 0.5 / 0.8) < 0.03  # 0.625 within ~4 standard deviations of 4000 draws


@pytest.mark.parametrize("loops", [False, True])  # the running sums as masked reductions (GPU), or jnp.cumsum
@pytest.mark.parametrize("vocab", [5, 128, 1000, 9000])
def test_draw_follows_the_weights_over_blocks_and_never_takes_a_zero_weight(vocab, loops):
    rng = np.random.default_rng(vocab)
    weights = np.zeros(vocab, np.float32)
    positive = rng.choice(vocab, min(vocab, 4), replace=False)  # in several blocks (and groups) of the draw's levels
    weights[positive] = [0.4, 0.3, 0.2, 0.1][: len(positive)]
    rows = 20000
    keys = jax.vmap(jax.random.key)(jnp.arange(rows, dtype=jnp.uint32))
    ids = np.asarray(draw(keys, jnp.asarray(np.tile(weights, (rows, 1))), loops=loops))
    assert set(ids.tolist()) <= set(positive.tolist())
    for index in positive:  # each frequency within ~5 standard deviations of its weight's share
        share = weights[index] / weights.sum()
        assert abs((ids == index).mean() - share) < 5 * np.sqrt(share * (1 - share) / rows)


@pytest.mark.parametrize("loops", [False, True])
def test_draw_follows_many_small_weights_spread_over_every_group(loops):
    rows, vocab = 4096, 3 * sampler.DRAW_GROUP * sampler.DRAW_BLOCK - 77  # three groups, the last one partial
    weights = np.random.default_rng(3).uniform(0, 1, vocab).astype(np.float32)
    weights[::7] = 0
    keys = jax.vmap(jax.random.key)(jnp.arange(rows, dtype=jnp.uint32))
    ids = np.asarray(draw(keys, jnp.asarray(np.tile(weights, (rows, 1))), loops=loops))
    assert (weights[ids] > 0).all()
    # the mass of each tenth of the vocabulary, drawn against its share
    edges = np.linspace(0, vocab, 11).astype(int)
    drawn = np.histogram(ids, bins=edges)[0] / rows
    share = np.add.reduceat(weights, edges[:-1]) / weights.sum()
    assert np.all(np.abs(drawn - share) < 5 * np.sqrt(share * (1 - share) / rows))


@pytest.mark.parametrize("loops", [False, True])
@pytest.mark.parametrize("vocab", [300, 9000])
def test_draw_takes_the_only_positive_weight_at_either_end_of_the_vocabulary(vocab, loops):
    keys = jax.vmap(jax.random.key)(jnp.arange(64, dtype=jnp.uint32))
    for index in (0, vocab - 1):
        weights = np.zeros((64, vocab), np.float32)
        weights[:, index] = 1e-30  # tiny: the uniform number times the sum rounds to it or past it
        assert set(np.asarray(draw(keys, jnp.asarray(weights), loops=loops)).tolist()) == {index}


@pytest.mark.parametrize("loops", [False, True])
@pytest.mark.parametrize("fill", [np.nan, 0.0])
def test_a_row_without_a_positive_weight_still_draws_a_token_of_the_vocabulary(fill, loops):
    keys = jax.vmap(jax.random.key)(jnp.arange(8, dtype=jnp.uint32))
    weights = jnp.full((8, 300), fill, jnp.float32)  # NaN logits give NaN weights; 300 is not a whole block
    drawn = np.asarray(draw(keys, weights, loops=loops))
    assert ((drawn >= 0) & (drawn < 300)).all(), drawn


def test_running_sums_never_decrease_and_stay_level_over_zeros():
    values = jnp.asarray(np.random.default_rng(0).uniform(0, 1, (64, 128)).astype(np.float32) * 1e6)
    values = values.at[:, ::3].set(0)
    running = np.asarray(sampler._masked_running_sums(values))
    np.testing.assert_allclose(running, np.cumsum(np.asarray(values, np.float64), axis=-1), rtol=1e-5)
    assert (np.diff(running, axis=-1) >= 0).all()
    zeros = np.zeros(128, bool)
    zeros[::3] = True
    np.testing.assert_array_equal(running[:, 1:][:, zeros[1:]], running[:, :-1][:, zeros[1:]])


def test_the_search_is_a_loop_where_the_device_chooses_it():
    """Where the device chooses the filter search (TPU, CPU) the search runs as a loop inside the conditional:
    XLA:CPU took minutes to compile it unrolled there. (Where the host chose it, a GPU, the program holds no control
    flow: `test_no_sampling_program_holds_control_flow_the_host_would_run`.)"""
    probs = jnp.full((4, 300), 1 / 300, jnp.float32)
    device_chooses = batch_of([0] * 4, [0.9] * 4, [0.0] * 4, host_chooses=False)
    host_chose = batch_of([0] * 4, [0.9] * 4, [0.0] * 4)
    assert "stablehlo.while" in jax.jit(sampler._filter_thresholds).lower(probs, device_chooses).as_text()
    assert "stablehlo.while" not in jax.jit(sampler._filter_thresholds).lower(probs, host_chose).as_text()


def numpy_log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = np.random.default_rng(3).standard_normal((4, 50)).astype(np.float32)
    batch = batch_of([0, 0, 5, 0], [1.0, 0.9, 1.0, 1.0], [0.0] * 4)
    batch = SamplingBatch(**{**batch.__dict__, "temperature": jnp.asarray([0.0, 1.0, 0.0, 1.0], jnp.float32)})
    ids = np.asarray(sample(jnp.asarray(logits), batch).next_ids)
    assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()
    all_greedy = SamplingBatch(**{**batch.__dict__, "is_greedy": True})
    np.testing.assert_array_equal(np.asarray(sample(jnp.asarray(logits), all_greedy).next_ids), logits.argmax(-1))


def test_logprobs_are_the_unfiltered_model_distribution():
    logits = np.random.default_rng(4).standard_normal((3, 40)).astype(np.float32)
    batch = SamplingBatch(
        **{**batch_of([2, 0, 0], [1.0, 0.5, 1.0], [0.0, 0.0, 0.3], temperature=0.7).__dict__, "num_top_logprobs": 5}
    )
    out = sample(jnp.asarray(logits), batch)
    want = numpy_log_softmax(logits.astype(np.float64))
    ids = np.asarray(out.next_ids)
    np.testing.assert_allclose(np.asarray(out.next_logprobs), want[np.arange(3), ids], rtol=1e-5, atol=1e-5)
    order = np.argsort(-want, axis=-1)[:, :5]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(want, order, -1), rtol=1e-5, atol=1e-5)


def test_prompt_logprobs_score_the_given_targets():
    logits = np.random.default_rng(5).standard_normal((6, 30)).astype(np.float32)
    targets = np.array([0, 29, 3, 3, 17, 8], np.int32)
    out = token_logprobs(jnp.asarray(logits), jnp.asarray(targets), num_top=2)
    want = numpy_log_softmax(logits.astype(np.float64))
    np.testing.assert_array_equal(np.asarray(out.next_ids), targets)
    np.testing.assert_allclose(np.asarray(out.next_logprobs), want[np.arange(6), targets], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-want, axis=-1)[:, :2])
    assert token_logprobs(jnp.asarray(logits), jnp.asarray(targets), num_top=0).top_ids.shape == (6, 0)


@pytest.mark.parametrize("num_rows", [7, 16, 37])
def test_prompt_logprobs_in_row_chunks_equal_one_call(num_rows):
    rng = np.random.default_rng(num_rows)
    hidden = jnp.asarray(rng.standard_normal((num_rows, 12)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((12, 50)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, num_rows), jnp.int32)
    whole = token_logprobs(hidden @ head, targets, 5)
    chunked = chunked_token_logprobs(lambda h: h @ head, hidden, targets, 5, rows_per_chunk=8)
    assert chunked.next_logprobs.shape == (num_rows,) and chunked.top_ids.shape == (num_rows, 5)
    np.testing.assert_array_equal(chunked.next_ids, whole.next_ids)
    np.testing.assert_array_equal(chunked.top_ids, whole.top_ids)
    np.testing.assert_allclose(chunked.next_logprobs, whole.next_logprobs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(chunked.top_logprobs, whole.top_logprobs, rtol=1e-6, atol=1e-6)


def test_a_rows_draw_depends_on_its_seed_and_step_alone():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((4, 64)).astype(np.float32)
    batch = batch_of([0, 10, 0, 0], [1.0, 1.0, 0.8, 1.0], [0.0, 0.0, 0.0, 0.05])
    batch = SamplingBatch(
        **{
            **batch.__dict__,
            "seeds": jnp.asarray([11, 12, 13, 14], jnp.uint32),
            "steps": jnp.asarray([0, 3, 7, 2], jnp.int32),
        }
    )
    together = np.asarray(sample(jnp.asarray(logits), batch).next_ids)
    for row in range(4):
        alone = SamplingBatch(
            **{k: (v[row : row + 1] if isinstance(v, jnp.ndarray) else v) for k, v in batch.__dict__.items()}
        )
        assert int(sample(jnp.asarray(logits[row : row + 1]), alone).next_ids[0]) == together[row]


def test_temperature_is_applied_before_the_filters():
    # top_p 0.6 on [0.5, 0.3, 0.2] keeps two tokens; at temperature 0.25 the first holds ~0.85: it alone is kept
    logits = np.log(np.array([[0.5, 0.3, 0.2]] * 200, np.float32))
    batch = batch_of([0] * 200, [0.6] * 200, [0.0] * 200, temperature=0.25)
    batch = SamplingBatch(**{**batch.__dict__, "seeds": jnp.arange(200, dtype=jnp.uint32)})
    assert set(np.asarray(sample(jnp.asarray(logits), batch).next_ids).tolist()) == {0}
    scaled = logits / 0.25
    want = reference_mask(scaled, np.zeros(200, int), np.full(200, 0.6, np.float32), np.zeros(200, np.float32))
    assert want[:, 0].all() and not want[:, 1:].any()


@pytest.mark.parametrize("num_top", [0, 3])
@pytest.mark.parametrize("greedy, filters", sampler.GPU_SAMPLING_MODES)
def test_no_sampling_program_holds_control_flow_the_host_would_run(greedy, filters, num_top):
    # On a GPU, XLA runs a conditional or a loop by reading its predicate on the host: the engine loop would wait for
    # the forward before the sampling program, and the overlap schedule would be lost for every sampled step.
    assert sampler.sampling_modes("gpu") == sampler.GPU_SAMPLING_MODES
    batch = SamplingBatch(**{**batch_of([0] * 4, [0.9] * 4, [0.0] * 4).__dict__, "is_greedy": greedy})
    batch = SamplingBatch(**{**batch.__dict__, "filters": filters, "num_top_logprobs": num_top})
    # lowered for the GPU (on this CPU: the CPU lowering runs the PRNG's rounds in a loop of its own)
    exported = jax.export.export(jax.jit(sample), platforms=["cuda"])(
        jax.ShapeDtypeStruct((4, 300), jnp.float32), batch
    )
    text = exported.mlir_module()
    for op in ("stablehlo.while", "stablehlo.case", "stablehlo.if"):
        assert op not in text, f"{op} in the sampling program of mode {(greedy, filters, num_top)}"
