"""The base GEMM kernel without LoRA (pallas_kernels/sgmv/gemm_gpu.py: gemm_lora_gpu.py's kernel, has_lora=False).

On CPU: the pure-JAX reference (what the engine computes there) against x @ W[layer], the shape checks, the tile
choice against the shared-memory budget, and the kernel traced for Mosaic GPU (its jaxpr, as a GPU would build it).
Tests marked `gpu` run the kernel itself against the reference and are skipped without a Hopper-class CUDA device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sgmv.gemm_gpu import (
    base_kernel_call,
    check_gemm_shapes,
    choose_gemm_tiles,
    choose_k_splits,
    gemm_gpu,
    gemm_gpu_rows,
    is_hopper,
    silu_and_mul,
)
from pallas_kernels.sgmv.gemm_lora_gpu import GemmLoraTiles

HAS_HOPPER = is_hopper(jax.devices()[0])


def operands(seed: int, num_tokens: int, in_dim: int, out_dim: int, layers: int = 3):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((layers, in_dim, out_dim)) / np.sqrt(in_dim), jnp.bfloat16)
    return x, w


def expected(x, w_layer):
    return jnp.dot(x.astype(jnp.float32), w_layer.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def test_reference_is_x_at_the_layers_w():
    x, w = operands(0, 256, 128, 512)
    y = jax.jit(lambda x, w, layer: gemm_gpu(x, w, layer, reference=True))(x, w, jnp.int32(1))
    assert y.shape == (256, 512) and y.dtype == jnp.bfloat16
    want = expected(x, w[1])
    assert np.abs(np.asarray(y, np.float32) - want).max() <= 1e-2 * np.abs(want).max()  # bf16 output
    unstacked = gemm_gpu(x, w[2], reference=True)
    np.testing.assert_array_equal(
        np.asarray(unstacked, np.float32), np.asarray(gemm_gpu(x, w, 2, reference=True), np.float32)
    )


def test_rows_after_num_rows_are_zero_and_the_rest_unchanged():
    """num_rows names the real tokens of a padded bucket: y is zero from that row on (the kernel leaves the padding's
    row tiles unwritten and the wrapper zeroes them), equal to the full product before it; traced as one program
    for every count, so the count is data, not a shape."""
    x, w = operands(1, 384, 128, 512)
    full = gemm_gpu(x, w, jnp.int32(1), reference=True)
    call = jax.jit(lambda x, w, rows: gemm_gpu(x, w, jnp.int32(1), rows, reference=True))
    for rows in (0, 1, 127, 128, 200, 384):
        y = np.asarray(call(x, w, jnp.full((1,), rows, jnp.int32)), np.float32)
        np.testing.assert_array_equal(y[:rows], np.asarray(full, np.float32)[:rows])
        assert not y[rows:].any(), rows
    assert call._cache_size() == 1


@pytest.mark.parametrize(
    "num_tokens,in_dim,out_dim,why",
    [
        (200, 128, 512, "T not a multiple of 128"),
        (256, 96, 512, "in not a multiple of 64"),
        (256, 128, 384, "out not a multiple of 256"),
    ],
)
def test_shapes_that_do_not_fit_the_tiles_are_refused(num_tokens, in_dim, out_dim, why):
    x, w = operands(1, num_tokens, in_dim, out_dim, layers=1)
    with pytest.raises(ValueError, match="gemm_gpu: .* do not fit tiles"):
        gemm_gpu(x, w[0], reference=True)
    with pytest.raises(ValueError, match="do not fit tiles"):
        check_gemm_shapes(num_tokens, in_dim, out_dim, choose_gemm_tiles())


def test_mismatched_operands_are_refused():
    x, w = operands(2, 256, 128, 512, layers=1)
    with pytest.raises(ValueError, match="does not match W"):
        gemm_gpu(x.astype(jnp.float32), w[0], reference=True)


def test_tiles_fit_shared_memory_without_the_lora_tiles():
    """No s or B tiles: the deepest pipeline with the widest epilogue stores fits, which rank 16 does not."""
    tiles = choose_gemm_tiles()
    assert (tiles.stages, tiles.epilogue_n) == (4, 64)
    assert tiles.smem_bytes(0) + 1024 <= 227 * 1024 < tiles.smem_bytes(16) + 1024


def test_the_kernel_traces_without_lora_operands(monkeypatch):
    """The kernel body with has_lora=False, traced as on a GPU (its jaxpr: no device needed): the layer's first row
    its only scalar operand, x and W tiles in shared memory, and no s or B tiles."""

    class FakeHopper:
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [FakeHopper()])
    x, w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16), jax.ShapeDtypeStruct((3 * 256, 512), jnp.bfloat16)
    row = jax.ShapeDtypeStruct((1,), jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda *a: gemm_gpu_rows(*a, tiles=choose_gemm_tiles()))(x, w, row, row))
    assert "bf16[4,16,1,8,64]" in jaxpr and "bf16[4,8,4,8,64]" in jaxpr  # 4 stages of x and W tiles
    assert ",16]" not in jaxpr  # no [.., R=16] LoRA tiles (the LoRA kernel at rank 16 has them)


LLAMA3_8B_MODULES = {  # (in, out) of the layer linears
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
@pytest.mark.parametrize("module", sorted(LLAMA3_8B_MODULES))
def test_gemm_gpu_matches_reference_at_llama3_8b_sizes(module):
    """2048 tokens through each Llama-3-8B layer linear, W layer 1 of a 3-layer stack read in place, in bf16."""
    in_dim, out_dim = LLAMA3_8B_MODULES[module]
    x, w = operands(3, 2048, in_dim, out_dim)
    y = gemm_gpu(x, w, jnp.int32(1)).astype(jnp.float32)
    want = expected(x, w[1])
    assert float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want))) < 1e-2  # bf16 output
    reference = gemm_gpu(x, w, jnp.int32(1), reference=True).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(y - reference)) / jnp.max(jnp.abs(want))) < 1e-2
    assert float(jnp.max(jnp.abs(y - expected(x, w[0])))) > 0.1 * float(jnp.max(jnp.abs(want)))  # not layer 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
@pytest.mark.parametrize("module", ["qkv", "down"])
@pytest.mark.parametrize("num_tokens,k_splits", [(512, None), (512, 1), (2048, None)])
def test_the_padding_row_tiles_are_skipped(module, num_tokens, k_splits):
    """A bucket with fewer real tokens (a decode step of 345 rows in the 512 bucket, a chunked step of 1,900 in the
    2048 one, none, one, whole tiles): the real rows equal the full kernel's, bit for bit (the same tiles, only
    fewer of them), and the rest are zero, with the K loop split (the default at 512) or whole; every tile whole
    (the tail split's pieces depend on the row count: test_tail_split_matches_reference_at_decode_rows)."""
    in_dim, out_dim = LLAMA3_8B_MODULES[module]
    x, w = operands(6, num_tokens, in_dim, out_dim)
    full = np.asarray(gemm_gpu(x, w, jnp.int32(1), k_splits=k_splits, tail_split=False), np.float32)
    call = jax.jit(lambda x, w, rows: gemm_gpu(x, w, jnp.int32(1), rows, k_splits=k_splits, tail_split=False))
    for rows in (0, 1, 128, 345, 1900, num_tokens):
        rows = min(rows, num_tokens)
        y = np.asarray(call(x, w, jnp.full((1,), rows, jnp.int32)), np.float32)
        np.testing.assert_array_equal(y[:rows], full[:rows])
        assert not y[rows:].any(), rows


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
def test_gemm_gpu_with_other_tiles():
    x, w = operands(4, 384, 512, 1024, layers=2)
    tiles = GemmLoraTiles(stages=3, epilogue_n=32)
    y = gemm_gpu(x, w, jnp.int32(1), tiles=tiles).astype(jnp.float32)
    want = expected(x, w[1])
    assert float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want))) < 1e-2


@pytest.mark.parametrize(
    "num_tokens,expected_splits",
    [(128, {"qkv": 4, "o": 8, "gate_up": 1, "down": 8}), (256, {"qkv": 2, "o": 4, "gate_up": 1, "down": 4})]
    + [(t, {"qkv": 1, "o": 2, "gate_up": 1, "down": 2}) for t in (512,)]
    + [(t, dict.fromkeys(LLAMA3_8B_MODULES, 1)) for t in (1024, 2048)],
)
def test_k_splits_fill_one_wave_over_the_sms(num_tokens, expected_splits):
    """At decode sizes the CTA tiles alone leave most of an H100's 132 SMs idle: the K loop is cut into parts so
    that tiles x parts fit one wave, never more; from 1024 tokens the tiles fill the GPU unsplit."""
    tiles = choose_gemm_tiles()
    for module, (in_dim, out_dim) in LLAMA3_8B_MODULES.items():
        splits = choose_k_splits(num_tokens, in_dim, out_dim, tiles, num_sms=132)
        assert splits == expected_splits[module], module
        num_tiles = (num_tokens // 128) * (out_dim // 256)
        assert splits == 1 or num_tiles * splits <= 132
        assert (in_dim // tiles.tile_k) % splits == 0


def test_split_tiles_fit_shared_memory_with_float32_parts():
    tiles = choose_gemm_tiles(k_splits=4)
    assert tiles.epilogue_n == 32 and tiles.stages == 4
    assert tiles.smem_bytes(0, out_itemsize=4) + 1024 <= 227 * 1024


def test_split_k_traces_to_float32_parts_summed_once(monkeypatch):
    """The kernel with the K loop in 4 parts, traced as on a GPU: it writes [4 * T, out] float32 parts, and one sum
    over them gives the bf16 [T, out]; a split that does not divide the K steps is refused."""

    class FakeHopper:
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [FakeHopper()])
    x, w = jax.ShapeDtypeStruct((128, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((2 * 1024, 512), jnp.bfloat16)
    row = jax.ShapeDtypeStruct((1,), jnp.int32)
    call = lambda *a: gemm_gpu_rows(*a, tiles=choose_gemm_tiles(4), k_splits=4)  # noqa: E731
    jaxpr = jax.make_jaxpr(call)(x, w, row, row)
    assert "f32[512,512]" in str(jaxpr) and "reduce_sum" in str(jaxpr)
    assert jaxpr.out_avals[0].shape == (128, 512) and jaxpr.out_avals[0].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="do not split into 3 equal parts"):
        gemm_gpu(jnp.zeros((128, 1024), jnp.bfloat16), jnp.zeros((1024, 512), jnp.bfloat16), k_splits=3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
@pytest.mark.parametrize("num_tokens", [128, 256])
@pytest.mark.parametrize("module", sorted(LLAMA3_8B_MODULES))
def test_split_k_matches_reference_at_decode_sizes(module, num_tokens):
    """Decode-sized T through each Llama-3-8B layer linear with the splits the GPU's SMs call for (o and down split
    4 or 8 ways), W layer 2 of a 3-layer stack read in place."""
    in_dim, out_dim = LLAMA3_8B_MODULES[module]
    x, w = operands(5, num_tokens, in_dim, out_dim)
    y = gemm_gpu(x, w, jnp.int32(2)).astype(jnp.float32)
    want = expected(x, w[2])
    assert float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want))) < 1e-2  # bf16 output
    for splits in (2, 8):
        forced = gemm_gpu(x, w, jnp.int32(2), k_splits=splits).astype(jnp.float32)
        assert float(jnp.max(jnp.abs(forced - y)) / jnp.max(jnp.abs(want))) < 1e-2, splits


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
@pytest.mark.parametrize("module", sorted(LLAMA3_8B_MODULES))
def test_tail_split_matches_reference_at_decode_rows(module):
    """Decode steps of 1024, 751, 600 and 200 rows in the 1024 bucket and 369 in the 512 one, the last partial
    wave's tiles in pieces of K added into a zeroed output (gate|up forced: its default keeps every tile whole):
    within bf16 rounding of x @ W[layer] on the real rows (a piece's part is rounded before it is added), zero after
    them, and the layer read is layer 1's."""
    in_dim, out_dim = LLAMA3_8B_MODULES[module]
    for num_tokens, rows_list in ((1024, (1024, 751, 600, 200)), (512, (369,))):
        x, w = operands(7, num_tokens, in_dim, out_dim)
        call = jax.jit(lambda x, w, rows: gemm_gpu(x, w, jnp.int32(1), rows, k_splits=1, tail_split=True))
        want = np.asarray(expected(x, w[1]))
        scale = np.abs(want).max()
        for rows in rows_list:
            y = np.asarray(call(x, w, jnp.full((1,), rows, jnp.int32)), np.float32)
            assert np.abs(y[:rows] - want[:rows]).max() < 2e-2 * scale, (num_tokens, rows)
            assert not y[rows:].any(), (num_tokens, rows)
        other = np.asarray(expected(x, w[0]))
        assert np.abs(y[:rows] - other[:rows]).max() > 0.1 * scale  # not layer 0


# ---- gated: silu(x @ W_gate) * (x @ W_up) in the kernel's epilogue ------------------------------------------------


def expected_gated(x, w_layer, num_rows: int | None = None, delta=None) -> np.ndarray:
    """silu(gate) * up from the float32 product, each half rounded to bf16 first as the kernel's epilogue does (with
    a delta, added to the rounded product and the sum rounded to bf16)."""
    y = np.asarray(expected(x, w_layer).astype(jnp.bfloat16), np.float32)
    if delta is not None:
        y = np.asarray(jnp.asarray(y + np.asarray(delta, np.float32)).astype(jnp.bfloat16), np.float32)
    gate, up = np.split(y, 2, axis=1)
    out = gate / (1 + np.exp(-gate)) * up
    if num_rows is not None:
        out[num_rows:] = 0
    return out


def test_gated_reference_is_silu_of_gate_times_up():
    x, w = operands(11, 256, 128, 512)
    rows = jnp.array([200], jnp.int32)
    y = jax.jit(lambda x, w: gemm_gpu(x, w, jnp.int32(1), rows, gated=True, reference=True))(x, w)
    assert y.shape == (256, 256) and y.dtype == jnp.bfloat16
    want = expected_gated(x, w[1], 200)
    assert np.abs(np.asarray(y, np.float32) - want).max() <= 2e-2 * np.abs(want).max()
    assert not np.asarray(y, np.float32)[200:].any()
    np.testing.assert_array_equal(  # the reference is what the unfused layers compute
        np.asarray(y, np.float32)[:200],
        np.asarray(silu_and_mul(gemm_gpu(x, w, jnp.int32(1), reference=True)), np.float32)[:200],
    )


def test_gated_reference_adds_the_delta_before_the_activation():
    """With a delta (gate|up's LoRA delta), the reference is the unfused layers' silu of (product + delta): the
    packed product rounded to bf16, plus the delta, split, then the activation."""
    x, w = operands(14, 256, 128, 512)
    delta = jnp.asarray(np.random.default_rng(15).standard_normal((256, 512)), jnp.bfloat16)
    rows = jnp.array([200], jnp.int32)
    y = jax.jit(lambda x, w, d: gemm_gpu(x, w, jnp.int32(1), rows, gated=True, delta=d, reference=True))(x, w, delta)
    product = gemm_gpu(x, w, jnp.int32(1), reference=True)
    unfused = np.asarray(silu_and_mul(product + delta), np.float32)
    np.testing.assert_array_equal(np.asarray(y, np.float32)[:200], unfused[:200])
    assert not np.asarray(y, np.float32)[200:].any()
    want = expected_gated(x, w[1], 200, delta)
    assert np.abs(np.asarray(y, np.float32) - want).max() <= 2e-2 * np.abs(want).max()
    assert np.abs(want - expected_gated(x, w[1], 200)).max() > 0.1 * np.abs(want).max()  # the delta counts


def test_a_delta_goes_only_to_the_gated_kernel_in_its_shape():
    x, w = operands(16, 256, 128, 512)
    with pytest.raises(ValueError, match="pass gated=True"):
        gemm_gpu(x, w, jnp.int32(0), delta=jnp.zeros((256, 512), jnp.bfloat16), reference=True)
    with pytest.raises(ValueError, match=r"shape \(256, 512\)"):
        gemm_gpu(x, w, jnp.int32(0), gated=True, delta=jnp.zeros((256, 256), jnp.bfloat16), reference=True)
    with pytest.raises(ValueError, match="bfloat16"):
        gemm_gpu(x, w, jnp.int32(0), gated=True, delta=jnp.zeros((256, 512), jnp.float32), reference=True)


def test_the_delta_tiles_take_a_pipeline_stage():
    """The gated kernel's delta tiles (64 KB: two warpgroups' rows of a gate and an up block) fit shared memory
    beside 3 stages and 32-column stores; the kernel without them keeps 4 stages and 64-column stores."""
    tiles = choose_gemm_tiles(gated_delta=True)
    assert (tiles.stages, tiles.epilogue_n) == (3, 32)
    assert tiles.smem_bytes(0, gated_delta=True) <= 227 * 1024 - 1024
    assert tiles.smem_bytes(0) + 64 * 1024 == tiles.smem_bytes(0, gated_delta=True)
    assert (choose_gemm_tiles().stages, choose_gemm_tiles().epilogue_n) == (4, 64)


def test_gated_refuses_what_it_does_not_run():
    x, w = operands(12, 256, 128, 512)
    with pytest.raises(ValueError, match="one K loop per tile"):
        gemm_gpu(x, w, jnp.int32(0), gated=True, k_splits=2)
    with pytest.raises(ValueError, match="without the tail split"):
        gemm_gpu(x, w, jnp.int32(0), gated=True, tail_split=True)
    x, w = operands(12, 256, 128, 384)  # gate and up of 192 columns: not whole 128-column CTA tiles
    with pytest.raises(ValueError, match="out=192 .* out of 128"):
        gemm_gpu(x, w, jnp.int32(0), gated=True, reference=True)


def mosaic_gpu_interpreter():
    """JAX's Mosaic GPU interpreter params (runs a kernel body on CPU), or None where this JAX has none."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        return None
    return InterpretGPUParams()


@pytest.mark.parametrize(
    "num_tokens,in_dim,inter_dim,num_rows",
    [(384, 256, 256, 200), (512, 128, 384, 100), (128, 128, 640, 128)],
    ids=["one-padding-row-tile", "three-padding-row-tiles-over-2-waves", "one-row-tile-5-column-tiles"],
)
@pytest.mark.parametrize("with_delta", [False, True], ids=["", "delta"])
def test_the_gated_kernel_in_the_mosaic_gpu_interpreter(num_tokens, in_dim, inter_dim, num_rows, with_delta):
    """The gated kernel call (as gemm_gpu_rows makes it) run by the interpreter on 5 "SMs" over layer 1 of a 2-layer
    stack: each warpgroup's half of a tile's rows, gate and up fetched from their two column blocks, the activation
    in the epilogue; the real rows within bf16 rounding of silu(gate) * up (one rounding of the product), and the
    padding's row tiles zeroed by the kernel (the interpreter fills what a kernel leaves unwritten with NaN). With a
    delta: its gate and up blocks of each tile added before the activation."""
    interpret = mosaic_gpu_interpreter()
    if interpret is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2 * in_dim, 2 * inter_dim)) / np.sqrt(in_dim), jnp.bfloat16)
    delta = jnp.asarray(rng.standard_normal((num_tokens, 2 * inter_dim)), jnp.bfloat16) if with_delta else None
    run = jax.jit(
        lambda x, w, delta: base_kernel_call(
            x,
            w,
            jnp.array([in_dim], jnp.int32),
            jnp.array([num_rows], jnp.int32),
            tiles=choose_gemm_tiles(gated_delta=with_delta),
            num_sms=5,
            gated=True,
            delta=delta,
            interpret=interpret,
        )
    )
    y = np.asarray(run(x, w, delta), np.float32)
    assert y.shape == (num_tokens, inter_dim)
    want = expected_gated(x, w[in_dim:], delta=delta)
    if with_delta:  # the delta moved the result
        assert np.abs(want - expected_gated(x, w[in_dim:]))[:num_rows].max() > 0.1 * np.abs(want).max()
    assert np.abs(y[:num_rows] - want[:num_rows]).max() <= 1e-2 * np.abs(want).max()
    up_only = np.split(np.asarray(expected(x, w[in_dim:])), 2, axis=1)[1]
    assert np.abs(y[:num_rows] - up_only[:num_rows]).max() > 0.1 * np.abs(want).max()  # the activation was applied
    padding_tiles = y[-(-num_rows // 128) * 128 :]
    assert not np.isnan(y).any() and not padding_tiles.any()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
def test_gated_matches_reference_at_llama3_8b_gate_up():
    """gate|up of Llama-3-8B (4096 -> 2 x 14336), layer 1 of a 3-layer stack read in place: 2048 tokens, 256, and
    decode steps of 751 rows in the 1024 bucket and 369 in the 512 one; silu(gate) * up within bf16 rounding on the
    real rows, the padding's row tiles zero."""
    in_dim, out_dim = LLAMA3_8B_MODULES["gate_up"]
    for num_tokens, num_rows in ((2048, 2048), (256, 256), (1024, 751), (512, 369)):
        x, w = operands(13, num_tokens, in_dim, out_dim)
        rows = jnp.full((1,), num_rows, jnp.int32)
        call = jax.jit(lambda x, w, rows: gemm_gpu(x, w, jnp.int32(1), rows, gated=True))
        y = np.asarray(call(x, w, rows), np.float32)
        want = expected_gated(x, w[1])[:num_rows]
        scale = np.abs(want).max()
        assert y.shape == (num_tokens, out_dim // 2)
        assert np.abs(y[:num_rows] - want).max() <= 1e-2 * scale, num_tokens
        assert not y[-(-num_rows // 128) * 128 :].any()
        assert np.abs(y[:num_rows] - expected_gated(x, w[0])[:num_rows]).max() > 0.1 * scale  # not layer 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
def test_gated_with_a_delta_matches_reference_at_llama3_8b_gate_up():
    """The gated kernel with gate|up's LoRA delta added before the activation, at the decode buckets that run it (256
    tokens, 369 rows in the 512 bucket, 751 in the 1024 one): within bf16 rounding of silu(gate + delta_gate) * (up +
    delta_up) on the real rows, the padding's row tiles zero, and apart from the result without the delta."""
    in_dim, out_dim = LLAMA3_8B_MODULES["gate_up"]
    for num_tokens, num_rows in ((256, 256), (512, 369), (1024, 751)):
        x, w = operands(17, num_tokens, in_dim, out_dim)
        delta = jnp.asarray(np.random.default_rng(18).standard_normal((num_tokens, out_dim)) * 0.5, jnp.bfloat16)
        rows = jnp.full((1,), num_rows, jnp.int32)
        call = jax.jit(lambda x, w, rows, d: gemm_gpu(x, w, jnp.int32(1), rows, gated=True, delta=d))
        y = np.asarray(call(x, w, rows, delta), np.float32)
        want = expected_gated(x, w[1], delta=delta)[:num_rows]
        scale = np.abs(want).max()
        assert y.shape == (num_tokens, out_dim // 2)
        assert np.abs(y[:num_rows] - want).max() <= 1e-2 * scale, num_tokens
        assert not y[-(-num_rows // 128) * 128 :].any()
        assert np.abs(y[:num_rows] - expected_gated(x, w[1])[:num_rows]).max() > 0.1 * scale  # the delta counts


# ---- every variant lowers for Mosaic GPU (on CPU) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "variant,k_splits",
    [("plain", 1), ("split-k", 2), ("tail-split", 1), ("gated", 1), ("gated-delta", 1), ("fp8", 1), ("fp8", 2)],
)
def test_each_variant_lowers_for_cuda(monkeypatch, variant, k_splits):
    """The kernel call of each variant at Llama-3-8B sizes (gate|up's 4096 -> 2 x 14336; 1024 rows), lowered for
    CUDA as a Hopper GPU with 132 SMs would run it (`.lower(lowering_platforms=("cuda",))`: the kernel body through
    Pallas' Mosaic GPU lowering, which refuses what it cannot lower); its output's shape and dtype."""
    from pallas_kernels.sgmv.gemm_fp8_gpu import choose_fp8_tiles, gemm_fp8_gpu_rows

    class FakeHopper:
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [FakeHopper()])
    row = jax.ShapeDtypeStruct((1,), jnp.int32)
    num_tokens, in_dim, out_dim = 1024, 4096, 28672
    gated = variant.startswith("gated")
    if variant == "fp8":
        fp8 = jnp.float8_e4m3fn
        x, w = jax.ShapeDtypeStruct((num_tokens, in_dim), fp8), jax.ShapeDtypeStruct((2 * out_dim, in_dim), fp8)
        w_scales, row_scales = jax.ShapeDtypeStruct((2,), jnp.float32), jax.ShapeDtypeStruct((num_tokens,), jnp.float32)
        args = (x, w, row, w_scales, row_scales, row)
        options = dict(out_dim=out_dim, tiles=choose_fp8_tiles(k_splits), k_splits=k_splits, out_dtype=jnp.bfloat16)
        lowered = gemm_fp8_gpu_rows.trace(*args, **options).lower(lowering_platforms=("cuda",))
    else:
        x = jax.ShapeDtypeStruct((num_tokens, in_dim), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((2 * in_dim, out_dim), jnp.bfloat16)
        delta = jax.ShapeDtypeStruct((num_tokens, out_dim), jnp.bfloat16) if variant == "gated-delta" else None
        options = dict(
            tiles=choose_gemm_tiles(k_splits, gated_delta=delta is not None),
            k_splits=k_splits,
            tail_split=variant == "tail-split",
            gated=gated,
        )
        lowered = gemm_gpu_rows.trace(x, w, row, row, delta, **options).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert lowered.out_info.shape == (num_tokens, out_dim // 2 if gated else out_dim)
    assert lowered.out_info.dtype == jnp.bfloat16


def kernel_output_is_returned(jaxpr, kernel_name: str) -> bool:
    """Whether a traced program's output is its one call of the jitted kernel entry `kernel_name`, as it is (no
    select after it)."""
    calls = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.params.get("name") == kernel_name]
    assert len(calls) == 1, [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
    return jaxpr.jaxpr.outvars[0] is calls[0].outvars[0]


def test_zero_padding_false_leaves_the_padding_rows_to_the_consumer():
    """zero_padding=False (q|k|v, whose consumer, the rotary + K/V write kernel, masks the padding itself): the
    reference returns every row's product, the padding's too, as the kernel returns its skipped rows unwritten; by
    default they are zero; the gated output is zero from num_rows on either way."""
    x, w = operands(8, 384, 128, 512)
    rows = jnp.array([200], jnp.int32)
    full = np.asarray(gemm_gpu(x, w, jnp.int32(1), reference=True), np.float32)
    kept = np.asarray(gemm_gpu(x, w, jnp.int32(1), rows, reference=True, zero_padding=False), np.float32)
    np.testing.assert_array_equal(kept, full)
    assert full[200:].any()
    zeroed = np.asarray(gemm_gpu(x, w, jnp.int32(1), rows, reference=True), np.float32)
    np.testing.assert_array_equal(zeroed[:200], full[:200])
    assert not zeroed[200:].any()
    gated = np.asarray(gemm_gpu(x, w, jnp.int32(1), rows, gated=True, reference=True, zero_padding=False), np.float32)
    gated_full = np.asarray(gemm_gpu(x, w, jnp.int32(1), gated=True, reference=True), np.float32)
    np.testing.assert_array_equal(gated[:200], gated_full[:200])
    assert gated_full[200:].any() and not gated[200:].any()


def test_the_kernel_path_leaves_out_the_select_with_zero_padding_false(monkeypatch):
    """Traced as on a GPU: by default the kernel's output goes through the select that zeroes the rows from num_rows
    on; with zero_padding=False the kernel's output is the result (its skipped row tiles as they are)."""

    class FakeHopper:
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [FakeHopper()])
    x, w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16), jax.ShapeDtypeStruct((2, 256, 512), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((1,), jnp.int32)
    for k_splits in (1, 2):
        for zero_padding in (True, False):
            call = lambda x, w, rows, k_splits=k_splits, zero_padding=zero_padding: gemm_gpu(  # noqa: E731
                x, w, jnp.int32(1), rows, k_splits=k_splits, tail_split=False, zero_padding=zero_padding
            )
            jaxpr = jax.make_jaxpr(call)(x, w, rows)
            assert kernel_output_is_returned(jaxpr, "gemm_gpu_rows") == (not zero_padding), (k_splits, zero_padding)
