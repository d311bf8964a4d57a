"""The tail split's schedule (pallas_kernels/sgmv/tail_split.py) and the base GEMM kernel traced with it.

On CPU: every (tile, K step) of a module's tiles is computed by exactly one work unit for any real row count, the
pieces are chosen the same traced (inside the kernel) and on Python ints, the kernel traced as on a GPU adds its
pieces into a zeroed output with TMA reduce-adds, and the kernel itself runs in JAX's Mosaic GPU interpreter on a
grid of 5 "SMs" (the interpreter has no TMA reduce-add: the test gives it one, a read, add and write of the target).
The kernel's results on a GPU are tested in test_gemm_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sgmv.gemm_gpu import (
    base_kernel_call,
    choose_gemm_tiles,
    default_tail_split,
    gemm_gpu,
    gemm_gpu_rows,
)
from pallas_kernels.sgmv.tail_split import MAX_PIECES, modeled_saving, tail_pieces, unit_work

LLAMA3_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


@pytest.mark.parametrize("num_sms", [132, 5])
@pytest.mark.parametrize("k_steps", [64, 224, 13, 3])
def test_every_tile_and_k_step_is_computed_once(num_sms, k_steps):
    tile_counts = sorted({*range(1, 12), *range(num_sms - 5, num_sms + 6), 2 * num_sms + 1, 6 * 24, 6 * 112})
    # one program for every count (the units padded to the most any count has), as the kernel traces it
    work = jax.jit(lambda units, whole, remaining, pieces: unit_work(units, whole, remaining, pieces, k_steps))
    all_units = np.arange(max(tile_counts) * MAX_PIECES, dtype=np.int32)
    for num_tiles in tile_counts:
        whole = num_tiles // num_sms * num_sms
        remaining = num_tiles - whole
        pieces = tail_pieces(remaining, num_sms, k_steps)
        num_units = whole + remaining * pieces
        tile, k_first, k_end, is_piece = (np.asarray(a)[:num_units] for a in work(all_units, whole, remaining, pieces))
        covered = np.zeros((num_tiles, k_steps), np.int32)
        for t, first, end in zip(tile, k_first, k_end):
            assert end > first, (num_tiles, t)
            covered[t, first:end] += 1
        np.testing.assert_array_equal(covered, 1)
        assert not is_piece[:whole].any() and (is_piece[whole:] == (pieces > 1)).all()  # one piece: a whole tile
        if remaining:  # the tail takes no more waves than the whole tiles would
            assert -(-remaining * pieces // num_sms) * -(-k_steps // pieces) <= k_steps


def test_pieces_fill_the_partial_wave():
    """Llama-3-8B at 751 real rows (6 row tiles) on 132 SMs: q|k|v's 12 leftover tiles go in 8 pieces (96 units in
    one wave of 8 K steps) and down's 96 tiles in 4 (3 waves of a quarter of its 224 steps); o's 96 tiles stay whole
    (3 waves of 16 steps and their overhead take longer than one of 64), and a full last wave is left whole."""
    assert tail_pieces(144 - 132, 132, 64) == MAX_PIECES
    assert tail_pieces(96, 132, 224) == 4 and tail_pieces(96, 132, 64) == 1
    assert tail_pieces(128, 132, 64) == 1 and tail_pieces(0, 132, 64) == 1


def test_traced_pieces_equal_the_python_ones():
    remaining = np.arange(0, 132)
    traced = jax.jit(jax.vmap(lambda r: tail_pieces(r, 132, 64)))(jnp.asarray(remaining, jnp.int32))
    np.testing.assert_array_equal(np.asarray(traced), [tail_pieces(int(r), 132, 64) for r in remaining])


def test_the_split_runs_where_the_tile_model_saves_time():
    """On 132 SMs (an H100 or H200), Llama-3-8B: q|k|v in the 512 and 1024 buckets, down in the 1024 one (o and down
    split their K loop statically below it); o's tail at 513-1024 rows is one piece at most row counts, gate|up's
    output is too wide to zero cheaply, and a K loop already split or a prefill bucket keeps every tile whole."""
    on = {
        (t, m) for t in (256, 512, 1024, 2048) for m, (i, o) in LLAMA3_8B.items() if default_tail_split(t, i, o, 1, 132)
    }
    assert {(512, "qkv"), (1024, "qkv"), (1024, "down")} <= on
    assert not on & {(1024, "o"), (512, "gate_up"), (1024, "gate_up"), (2048, "qkv"), (2048, "down")}
    assert modeled_saving(1024, 4096, 6144, 128, 256, 64, 132) > 0.15  # q|k|v: 12-60 leftover tiles at 6-8 row tiles
    assert not default_tail_split(256, 4096, 4096, 4, 132)  # split K already
    assert not default_tail_split(1024, 4096, 6144, 1, 0)  # not a GPU


def test_tail_split_traces_to_reduce_adds_into_a_zeroed_output(monkeypatch):
    class FakeHopper:
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [FakeHopper()])
    x, w = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((2 * 4096, 4096), jnp.bfloat16)
    row = jax.ShapeDtypeStruct((1,), jnp.int32)
    call = lambda *a: gemm_gpu_rows(*a, tiles=choose_gemm_tiles(), tail_split=True)  # noqa: E731
    jaxpr = jax.make_jaxpr(call)(x, w, row, row)
    text = str(jaxpr)
    adds = text.count("copy_smem_to_gmem[reduction_op=add]")
    assert 0 < adds < text.count("copy_smem_to_gmem")  # pieces add their parts, whole tiles store theirs
    assert "new_ref" in text  # the zeroed output the pieces add into
    assert jaxpr.out_avals[0].shape == (1024, 4096) and jaxpr.out_avals[0].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="one K loop per tile"):
        gemm_gpu(
            jnp.zeros((128, 1024), jnp.bfloat16), jnp.zeros((1024, 512), jnp.bfloat16), k_splits=2, tail_split=True
        )


def interpreter_with_reduce_add(monkeypatch):
    """JAX's Mosaic GPU interpreter params, its smem -> gmem copy given the TMA reduce-add it lacks; None (skip) where
    this JAX has no such interpreter, or one whose internals the emulated copy does not know."""
    try:
        from jax._src.pallas.mosaic.interpret import utils as interpret_utils
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, shared_memory
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        return None
    used = ("copy_smem_to_gmem", "_get_shared_memory", "HostAllocationKey", "_remove_noop_transforms")
    if not all(hasattr(gpu_callbacks, name) for name in used) or not all(
        hasattr(shared_memory.GPUSharedMemory, name) for name in ("get_global_thread_id", "get_buffer_content")
    ):  # the interpreter's internals differ in this JAX (they did from JAX 0.11)
        return None
    copy = gpu_callbacks.copy_smem_to_gmem

    def copy_with_reduce_add(*, reduction_op, **kwargs):
        if reduction_op is None:
            return copy(reduction_op=None, **kwargs)
        assert reduction_op == "add", reduction_op
        memory = gpu_callbacks._get_shared_memory()
        thread = memory.get_global_thread_id(int(kwargs["device_id"]), int(kwargs["thread_id"]))
        info = interpret_utils.GPULoggingInfo(
            device_id=int(kwargs["device_id"]),
            grid_point_coords=jax.tree.map(int, kwargs["grid_point_coords"]),
            thread_id=int(kwargs["thread_id"]),
            source_info=kwargs["source_info"],
        )

        def buffer(side):
            key = gpu_callbacks.HostAllocationKey.from_array(kwargs[f"{side}_allocation_key_as_array"])
            at = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(kwargs[f"{side}_transforms"]))
            return key, interpret_utils.to_range(at)

        src, dst = buffer("src"), buffer("dst")
        value = memory.get_buffer_content(*src, thread, logging_info=info)[0]
        target = memory.get_buffer_content(*dst, thread, logging_info=info)[0]
        total = (target.astype(np.float32) + value.astype(np.float32)).astype(target.dtype)
        memory.store_buffer_content(*dst, total, thread, logging_info=info)
        return kwargs["token"]

    monkeypatch.setattr(gpu_callbacks, "copy_smem_to_gmem", copy_with_reduce_add)
    return InterpretGPUParams()


@pytest.mark.parametrize(
    "num_tokens,in_dim,out_dim,num_rows",
    [(384, 512, 1024, 300), (128, 1024, 256, 100), (256, 832, 256, 256)],
    ids=["whole-waves-then-2-pieces", "one-tile-in-4-pieces", "uneven-pieces-of-13-steps"],
)
def test_the_kernel_in_the_mosaic_gpu_interpreter(monkeypatch, num_tokens, in_dim, out_dim, num_rows):
    """The tail-split kernel call (`base_kernel_call` with tail_split, as gemm_gpu_rows makes it) run by the interpreter on 5
    SMs over layer 1 of a 2-layer stack: whole waves then pieces (12 tiles: 10 whole, 2 in 2 pieces), one tile in 4
    pieces, 13 K steps cut 6 + 7; the real rows within bf16 rounding of x @ W[1], the padding's row tiles at zero."""
    interpret = interpreter_with_reduce_add(monkeypatch)
    if interpret is None:
        pytest.skip("this JAX has no Mosaic GPU interpreter")
    num_sms, tiles = 5, choose_gemm_tiles()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2 * in_dim, out_dim)) / np.sqrt(in_dim), jnp.bfloat16)
    run = jax.jit(
        lambda x, w: base_kernel_call(
            x,
            w,
            jnp.array([in_dim], jnp.int32),
            jnp.array([num_rows], jnp.int32),
            tiles=tiles,
            num_sms=num_sms,
            tail_split=True,
            interpret=interpret,
        )
    )

    y = np.asarray(run(x, w), np.float32)
    want = np.asarray(x, np.float32) @ np.asarray(w[in_dim:], np.float32)
    assert np.abs(y[:num_rows] - want[:num_rows]).max() < 2e-2 * np.abs(want).max()
    assert not y[-(-num_rows // 128) * 128 :].any()
