"""LoRA backends one operation at a time, for tests: a module's shrink, expand or whole LoRA (`apply`) over a
LoRABatch, through whichever backend `AutoBackend` picks for the bucket (the engine itself only calls
`prepare`, `apply_packed` and `apply_with_base`); random slot weights as the memory pool lays them out, a
per-token numpy reference of the delta, and the checks every backend's test runs against that reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax_lora.lora.backend.auto import AutoBackend
from sgl_jax_lora.lora.backend.base import LoRABackend
from sgl_jax_lora.lora.lora_batch import LoRABatch, build_lora_batch


def resolved(backend: LoRABackend, num_tokens: int, lora: LoRABatch, out_features: int = 0) -> LoRABackend:
    """The backend that runs a module of `out_features` columns in this bucket (AutoBackend: its choice)."""
    if isinstance(backend, AutoBackend):
        return backend.chosen(num_tokens, lora.num_segments, out_features)
    return backend


def shrink(
    backend: LoRABackend,
    x: jax.Array,
    lora_a: jax.Array,
    lora: LoRABatch,
    *,
    input_sharded: bool = False,
    rank_block: int | None = None,
) -> jax.Array:
    """x [T, in], lora_a [A, R, in] -> [T, R] float32."""
    chosen = resolved(backend, x.shape[0], lora)
    return chosen.shrink(x, lora_a, lora, input_sharded=input_sharded, rank_block=rank_block)


def expand(
    backend: LoRABackend,
    s: jax.Array,
    lora_b: jax.Array,
    lora: LoRABatch,
    *,
    output_sharded: bool = False,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """s [T, R] float32, lora_b [A, out, R] -> [T, out] out_dtype."""
    chosen = resolved(backend, s.shape[0], lora, lora_b.shape[1])
    return chosen.expand(s, lora_b, lora, output_sharded=output_sharded, out_dtype=out_dtype)


def apply(
    backend: LoRABackend,
    x: jax.Array,
    lora_a: jax.Array,
    lora_b: jax.Array,
    lora: LoRABatch,
    *,
    input_sharded: bool = False,
    output_sharded: bool = False,
    base_out: jax.Array | None = None,
) -> jax.Array:
    """One single-part module's LoRA as the engine runs it (`prepare`, then `apply_packed`): base_out + delta
    in base_out's dtype, or (no base_out) the delta alone in x.dtype."""
    if base_out is None:
        base_out = jnp.zeros((x.shape[0], lora_b.shape[1]), x.dtype)
    meta = backend.prepare(lora, num_seqs=x.shape[0])
    return backend.apply_packed(
        x, lora_a, (lora_b,), meta, base_out, tp_size=1, input_sharded=input_sharded, output_sharded=output_sharded
    )


def random_slots(
    seed: int, *, num_tokens: int, in_dim: int, out_dim: int, slot_ranks: tuple[int, ...], max_rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x [T, in], lora_a [A, R, in], lora_b [A, out, R], token_slot [T]) float32 / int32, as the memory pool lays
    slots out: slot 0 (the base model) and the rows and columns above each slot's rank are zero."""
    rng = np.random.default_rng(seed)
    ranks = np.array(slot_ranks)
    x = rng.standard_normal((num_tokens, in_dim)).astype(np.float32)
    row = np.arange(max_rank)
    live = row[None, :] < ranks[:, None]  # [A, R]
    lora_a = (rng.standard_normal((len(ranks), max_rank, in_dim)) * live[:, :, None]).astype(np.float32)
    lora_b = (rng.standard_normal((len(ranks), out_dim, max_rank)) * live[:, None, :]).astype(np.float32)
    token_slot = rng.integers(0, len(ranks), num_tokens).astype(np.int32)
    return x, lora_a, lora_b, token_slot


def per_token_reference(
    x: np.ndarray, lora_a: np.ndarray, lora_b: np.ndarray, token_slot: np.ndarray, slot_scale: np.ndarray
) -> np.ndarray:
    """[T, out] float64: scale[slot_t] * (x_t @ A[slot_t].T) @ B[slot_t].T, one token at a time in numpy."""
    x, lora_a, lora_b = (np.asarray(t, np.float64) for t in (x, lora_a, lora_b))
    out = np.zeros((x.shape[0], lora_b.shape[1]))
    for t, slot in enumerate(np.asarray(token_slot)):
        out[t] = slot_scale[slot] * ((x[t] @ lora_a[slot].T) @ lora_b[slot].T)
    return out


SLOT_RANKS = (0, 4, 8, 2)  # slot 0: the base model
SLOT_SCALE = np.array([0.0, 2.0, 0.5, 1.5], np.float32)
# f32: HIGHEST precision dots, rounding only. bf16: inputs, weights and the shrink result rounded to 8 significant
# bits (~2^-8 relative each) before float32 accumulation: within 2e-2 of the largest reference entry.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def slot_inputs(seed: int = 0, num_tokens: int = 24, num_segments: int = 4):
    """(x [T, 32], lora_a, lora_b, LoRABatch on the device) over SLOT_RANKS, with base, slot 1 and slot 3 tokens."""
    x, lora_a, lora_b, token_slot = random_slots(
        seed, num_tokens=num_tokens, in_dim=32, out_dim=24, slot_ranks=SLOT_RANKS, max_rank=8
    )
    token_slot[:3] = (0, 1, 3)  # every case present whatever the seed
    lora = build_lora_batch(token_slot, num_segments, SLOT_SCALE, np.array(SLOT_RANKS))
    return x, lora_a, lora_b, jax.tree_util.tree_map(jnp.asarray, lora)


def assert_close(actual, expected, dtype) -> None:
    actual = np.asarray(actual, np.float64)
    assert np.abs(actual - expected).max() <= TOLERANCE[dtype] * np.abs(expected).max()


def check_shrink_and_expand(backend: LoRABackend) -> None:
    """shrink then expand pick each token's own slot: x_t @ A[slot_t].T, then s_t @ B[slot_t].T."""
    x, lora_a, lora_b, lora = slot_inputs()
    s = jax.jit(backend.shrink)(jnp.asarray(x), jnp.asarray(lora_a), lora)
    slots = np.asarray(lora.token_slot)
    expected_s = np.einsum("ti,tri->tr", x.astype(np.float64), lora_a[slots].astype(np.float64))
    assert s.shape == (24, 8) and s.dtype == jnp.float32
    assert_close(s, expected_s, jnp.float32)
    y = jax.jit(backend.expand, static_argnames="out_dtype")(s, jnp.asarray(lora_b), lora, out_dtype=jnp.float32)
    assert y.shape == (24, 24) and y.dtype == jnp.float32
    assert_close(y, np.einsum("tr,tor->to", expected_s, lora_b[slots].astype(np.float64)), jnp.float32)


def check_apply_matches_the_per_token_reference(run, dtype) -> None:
    """`run(x, lora_a, lora_b, lora, base, dtype)`: base + the whole LoRA equals base + the per-token reference."""
    x, lora_a, lora_b, lora = slot_inputs(seed=1)
    base = np.random.default_rng(2).standard_normal((24, 24)).astype(np.float32)
    out = run(x, lora_a, lora_b, lora, base, dtype)
    assert out.dtype == dtype
    rounded = [np.asarray(jnp.asarray(t, dtype), np.float32) for t in (x, lora_a, lora_b)]
    delta = per_token_reference(*rounded, np.asarray(lora.token_slot), SLOT_SCALE)
    assert_close(np.asarray(out, np.float64) - np.asarray(jnp.asarray(base, dtype), np.float64), delta, dtype)
    assert np.abs(delta).max() > 1.0  # the adapters do change the output


def check_tokens_of_no_adapter_keep_the_base_output(run) -> None:
    """Rows of slot 0 come out equal to the base output bit for bit; the others do not."""
    x, lora_a, lora_b, lora = slot_inputs(seed=3)
    base = np.random.default_rng(4).standard_normal((24, 24)).astype(np.float32)
    out = np.asarray(run(x, lora_a, lora_b, lora, base, jnp.float32))
    no_adapter = np.asarray(lora.token_slot) == 0
    assert no_adapter.sum() >= 1
    np.testing.assert_array_equal(out[no_adapter], base[no_adapter])
    assert not np.array_equal(out[~no_adapter], base[~no_adapter])


def run_eagerly(backend: LoRABackend):
    """A `run` for the checks above: the backend's whole LoRA of one module, called as it is."""

    def run(x, lora_a, lora_b, lora, base, dtype):
        operands = [jnp.asarray(t, dtype) for t in (x, lora_a, lora_b)]
        return apply(backend, *operands, lora, base_out=jnp.asarray(base, dtype))

    return run
