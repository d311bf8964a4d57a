"""The gated SGMV expand (`sgmv_expand_gated_gpu`): gate|up's expand that reads the base product and writes the
MLP's activation, against the reference (the two parts' deltas from `sgmv_expand_ref` added to the base product,
then silu(gate) * up). On CPU in interpret mode; the test marked `gpu` runs the Triton kernel for real."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sgmv.gpu import choose_tiles, sgmv_expand_gated_gpu
from pallas_kernels.sgmv.reference import sgmv_expand_ref, sgmv_shrink_ref
from tests.pallas_kernels.sgmv.test_sgmv_kernels import HAS_CUDA, assert_close, make_case

pytestmark = pytest.mark.slow


def gated_case(seed: int, *, num_tokens: int, width: int, dtype=jnp.float32, **shape):
    """(case, up's B, [T, 2R] shrink of gate | up, [T, 2 * width] base product) for one gate|up module."""
    case = make_case(seed, num_tokens=num_tokens, out_dim=width, dtype=dtype, **shape)
    rank = case.lora_a.shape[1]
    up_b = (case.lora_b * -0.5).astype(dtype)
    s_gate = sgmv_shrink_ref(case.x, case.lora_a, *case.meta, rank_block=rank)
    s = jnp.concatenate([s_gate, s_gate * 0.75 + 0.1 * (s_gate != 0)], axis=1)
    base = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((num_tokens, 2 * width)), dtype)
    return case, up_b, s, base


def gated_reference(case, up_b, s, base, num_rows: int) -> jax.Array:
    """silu(gate + delta) * (up + delta), computed in float32, rows from num_rows on zero."""
    rank = case.lora_a.shape[1]
    scale = case.lora.slot_scale[case.lora.token_slot][:, None]
    gate_delta = sgmv_expand_ref(s[:, :rank] * scale, case.lora_b.astype(jnp.float32), *case.meta, jnp.float32)
    up_delta = sgmv_expand_ref(s[:, rank:] * scale, up_b.astype(jnp.float32), *case.meta, jnp.float32)
    width = case.lora_b.shape[1]
    base = base.astype(jnp.float32)
    gate, up = base[:, :width] + gate_delta, base[:, width:] + up_delta
    out = jax.nn.silu(gate) * up
    return jnp.where(jnp.arange(out.shape[0])[:, None] < num_rows, out, 0.0)


def run_gated(case, up_b, s, base, num_rows: int, *, interpret: bool = True, **kwargs) -> jax.Array:
    tiles = choose_tiles(s.shape[0], case.lora.num_segments, None, (case.lora_b.shape[1],), gated=True)
    return sgmv_expand_gated_gpu(
        s,
        (case.lora_b, up_b),
        base,
        jnp.array([num_rows], jnp.int32),
        *case.meta,
        case.lora.slot_scale,
        tiles=tiles,
        interpret=interpret,
        **kwargs,
    )


@pytest.mark.parametrize(
    "num_tokens, width, num_rows",
    [(40, 256, 40), (40, 256, 29), (1, 128, 1), (70, 88, 64)],
    ids=["all_rows", "padding_rows", "one_row", "odd_width"],
)
def test_gated_expand_matches_reference(num_tokens, width, num_rows):
    case, up_b, s, base = gated_case(3, num_tokens=num_tokens, width=width, max_rank=16, slot_ranks=(0, 4, 8, 16))
    out = run_gated(case, up_b, s, base, num_rows)
    assert out.shape == (num_tokens, width) and out.dtype == base.dtype
    assert_close(out, gated_reference(case, up_b, s, base, num_rows), jnp.float32)
    assert np.all(np.asarray(out)[num_rows:] == 0.0)


def test_gated_expand_of_base_rows_is_the_plain_activation_and_padding_nan_stays_out():
    # base tokens' rows get silu(gate) * up of the base product exactly; the padding rows' base product may hold
    # anything (the GEMM kernels leave them unwritten), NaN included, and they come out zero
    case, up_b, s, base = gated_case(5, num_tokens=48, width=128, max_rank=16, slot_ranks=(0, 16, 8))
    num_rows = 41
    base = base.at[num_rows:].set(jnp.nan)
    out = np.asarray(run_gated(case, up_b, s, base, num_rows))
    assert np.all(np.isfinite(out)) and np.all(out[num_rows:] == 0.0)
    is_base = np.asarray(case.lora.token_slot)[:num_rows] == 0
    plain = np.asarray(jax.nn.silu(base[:num_rows, :128]) * base[:num_rows, 128:])
    assert is_base.any()
    np.testing.assert_allclose(out[:num_rows][is_base], plain[is_base], rtol=1e-6, atol=1e-6)


def test_gated_expand_reads_one_layer_of_stacks_and_sums_shrink_partials():
    case, up_b, s, base = gated_case(7, num_tokens=40, width=256, max_rank=16, slot_ranks=(0, 4, 16))
    layer, num_layers = 2, 3

    def stack(w):
        return jnp.stack([w if i == layer else w * 3.0 + 1.0 for i in range(num_layers)])

    partials = jnp.stack([s * 0.25, s * 0.75])
    tiles = choose_tiles(40, case.lora.num_segments, None, (256,), gated=True)
    out = sgmv_expand_gated_gpu(
        partials,
        (stack(case.lora_b), stack(up_b)),
        base,
        jnp.array([40], jnp.int32),
        *case.meta,
        case.lora.slot_scale,
        layer=jnp.int32(layer),
        tiles=tiles,
        interpret=True,
    )
    assert_close(out, gated_reference(case, up_b, s, base, 40), jnp.float32)
    with pytest.raises(ValueError, match="must be \\[T, 2 \\* I\\]"):
        run_gated(case, up_b, s, base[:, :256], 40)


def test_gated_tiles_halve_the_widest_out_block():
    plain = choose_tiles(512, 33, None, (14336,))
    gated = choose_tiles(512, 33, None, (14336,), gated=True)
    assert plain.block_out == 256 and gated.block_out == 128


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "num_tokens, width, num_rows, slot_ranks",
    [(40, 256, 40, (0, 4, 8, 16)), (512, 1792, 369, (0,) + (16,) * 32), (256, 88, 200, (0, 16, 8))],
    ids=["t40", "t512_32_adapters", "odd_width"],
)
def test_gated_expand_on_device(dtype, num_tokens, width, num_rows, slot_ranks):
    case, up_b, s, base = gated_case(
        9, num_tokens=num_tokens, width=width, dtype=dtype, max_rank=16, slot_ranks=slot_ranks, num_segments=33
    )
    out = run_gated(case, up_b, s, base, num_rows, interpret=False)
    # bf16: each part is rounded to bf16 before the activation, as the unfused layer's add is
    assert_close(out, gated_reference(case, up_b, s, base, num_rows), dtype)
