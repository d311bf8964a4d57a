"""sgl_jax_lora/train/forward.py: frozen_dot (the custom-VJP base linear) gives the float32 product's value and x's
gradient and no gradient to the frozen kernel, trainable_dot gives both; the LoRA delta is PEFT's
(x @ A.T) @ B.T * scaling and absent modules add nothing; the causal GQA attention matches a numpy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.train.forward import _attention, _lora_delta, _plus, frozen_dot, trainable_dot

# bf16 keeps 8 significant bits (relative rounding ~2^-8 = 0.4% per element); a product of bf16 operands, and the
# backward's bf16 cast of the cotangent, stay within ~2e-2 of the float32 result relative to its largest entry
BF16_TOL = 2e-2


def operands(dtype, seed=0, rows=6, inner=16, cols=12):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, inner)), dtype)
    kernel = jnp.asarray(rng.standard_normal((inner, cols)), dtype)
    weights = jnp.asarray(rng.standard_normal((rows, cols)), jnp.float32)  # a loss that weighs every output
    return x, kernel, weights


def reference_loss(x, kernel, weights):
    return jnp.sum(jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32)) * weights)


def assert_close(actual, expected, tol):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert np.abs(actual - expected).max() <= tol * np.abs(expected).max()


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, BF16_TOL)], ids=["f32", "bf16"])
def test_frozen_dot_value_and_x_gradient_match_the_float32_product(dtype, tol):
    x, kernel, weights = operands(dtype)
    out = frozen_dot(x, kernel, jnp.float32)
    assert out.dtype == jnp.float32
    assert_close(out, np.asarray(x, np.float32) @ np.asarray(kernel, np.float32), tol)

    def loss(x, kernel):
        return jnp.sum(frozen_dot(x, kernel, jnp.float32) * weights)

    grad_x = jax.grad(loss)(x, kernel)
    assert grad_x.dtype == dtype  # the gradient comes back in x's dtype
    assert_close(grad_x, jax.grad(reference_loss)(x, kernel, weights), tol)


def test_frozen_dot_gives_the_kernel_no_gradient_and_trainable_dot_does():
    x, kernel, weights = operands(jnp.float32, seed=1)
    frozen_grad = jax.grad(lambda k: jnp.sum(frozen_dot(x, k, jnp.float32) * weights))(kernel)
    assert not np.asarray(frozen_grad).any()
    trainable_grads = jax.grad(lambda x, k: jnp.sum(trainable_dot(x, k, jnp.float32) * weights), argnums=(0, 1))(
        x, kernel
    )
    expected = jax.grad(reference_loss, argnums=(0, 1))(x, kernel, weights)
    for actual, wanted in zip(trainable_grads, expected):
        assert_close(actual, wanted, 1e-5)
    assert np.abs(np.asarray(expected[1])).max() > 0


def test_frozen_dot_casts_to_out_dtype_and_works_under_jit():
    x, kernel, weights = operands(jnp.bfloat16, seed=2)
    out = jax.jit(frozen_dot, static_argnums=2)(x, kernel, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    assert_close(out, np.asarray(x, np.float32) @ np.asarray(kernel, np.float32), BF16_TOL)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(frozen_dot(x, kernel, jnp.bfloat16).astype(jnp.float32) * weights)))(x)
    assert_close(grad, jax.grad(reference_loss)(x, kernel, weights), BF16_TOL)


def test_lora_delta_is_pefts_product_and_absent_modules_add_nothing():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    a, b = rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal((6, 2)).astype(np.float32)
    lora = {"q_proj": {"A": jnp.asarray(a), "B": jnp.asarray(b)}}
    delta = _lora_delta(jnp.asarray(x), lora, "q_proj", 0.5)
    np.testing.assert_allclose(np.asarray(delta), (x @ a.T) @ b.T * 0.5, rtol=1e-5, atol=1e-5)
    assert _lora_delta(jnp.asarray(x), lora, "v_proj", 0.5) is None
    y = jnp.ones((5, 6))
    assert _plus(y, None) is y
    np.testing.assert_allclose(np.asarray(_plus(y, delta)), 1.0 + np.asarray(delta), rtol=1e-6)


def numpy_causal_attention(q, k, v, scale, window=None):
    """q [B, S, H, D], k/v [B, S, K, D] -> [B, S, H * D]: query head h reads kv head h // (H / K), keys <= query (the
    last `window` of them, if given)."""
    batch, seq_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[2]
    out = np.zeros((batch, seq_len, num_heads, head_dim))
    for bi in range(batch):
        for h in range(num_heads):
            for s in range(seq_len):
                first = 0 if window is None else max(0, s - window + 1)
                scores = k[bi, first : s + 1, h // group] @ q[bi, s, h] * scale
                probs = np.exp(scores - scores.max())
                out[bi, s, h] = (probs / probs.sum()) @ v[bi, first : s + 1, h // group]
    return out.reshape(batch, seq_len, num_heads * head_dim)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attention_matches_a_causal_numpy_reference(num_kv_heads):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 5, num_kv_heads, 8)).astype(np.float32) for _ in range(2))
    out = _attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 8**-0.5)
    assert out.shape == (2, 5, 32) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), numpy_causal_attention(q, k, v, 8**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("traced", [False, True], ids=["static-window", "traced-window"])
def test_attention_within_a_sliding_window_matches_numpy(traced):
    # a static window (every layer's alike) or a traced one (a layer's, where windowed and full layers mix)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 7, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 7, 2, 8)).astype(np.float32) for _ in range(2))
    window, static = (jnp.int32(3), (3,)) if traced else (3, (3, 4))
    out = jax.jit(_attention, static_argnums=static)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 8**-0.5, window)
    np.testing.assert_allclose(np.asarray(out), numpy_causal_attention(q, k, v, 8**-0.5, 3), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 100], ids=["causal", "window-100"])
def test_cudnn_attention_in_bf16_matches_numpy(window):
    # 16-bit on the GPU takes cuDNN's flash attention, a static window as its local window
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 256, 8, 64)).astype(np.float32)
    k, v = (rng.standard_normal((2, 256, 2, 64)).astype(np.float32) for _ in range(2))
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    out = np.asarray(_attention(bf16(q), bf16(k), bf16(v), 0.125, window), np.float32)
    want = numpy_causal_attention(*(np.asarray(bf16(x), np.float32) for x in (q, k, v)), 0.125, window)
    np.testing.assert_allclose(out, want, atol=3e-2, rtol=0)


def test_attention_output_does_not_depend_on_later_tokens():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)  # the shapes above: their compiled ops are reused
    k, v = (rng.standard_normal((2, 5, 2, 8)).astype(np.float32) for _ in range(2))
    changed_k, changed_v = k.copy(), v.copy()
    changed_k[:, 3:], changed_v[:, 3:] = 100.0, -100.0  # e.g. right padding after 3 real tokens
    before = np.asarray(_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 8**-0.5))
    after = np.asarray(_attention(jnp.asarray(q), jnp.asarray(changed_k), jnp.asarray(changed_v), 8**-0.5))
    np.testing.assert_array_equal(after[:, :3], before[:, :3])
    assert not np.allclose(after[:, 3:], before[:, 3:])
