"""scripts/tune_gpu_sgmv.py's tile variants (also what `profile_step.py --pallas-variant` runs in the model):
each variant, on every Llama-3-8B module at the decode and prefill buckets, gives tiles the GPU kernels accept,
and changes what it says it changes."""

from __future__ import annotations

import pytest

from pallas_kernels.sgmv.gpu import choose_tiles
from scripts.bench_lora_kernels import make_lora
from scripts.tune_gpu_sgmv import MODULES, VARIANTS, patched_choose_tiles, use_variant
from sgl_jax_lora.lora.backend import pallas_gpu
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend

BUCKETS = [(64, 33), (256, 129), (4096, 33)]  # (tokens, segments)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("module", sorted(MODULES))
def test_variant_tiles_fit_the_kernels(variant, module):
    in_dim, widths, _ = MODULES[module]
    choose = patched_choose_tiles(VARIANTS[variant])
    for num_tokens, num_segments in BUCKETS:
        shrink = choose(num_tokens, num_segments, in_dim, None)
        assert (in_dim // shrink.block_in) % shrink.in_splits == 0  # every split runs whole `in` blocks
        expand = choose(num_tokens, num_segments, None, widths)
        assert all(w % (expand.block_out * expand.out_steps) == 0 for w in widths)  # whole program groups per part


def test_variants_change_what_they_name():
    in_dim, widths = 4096, (14336, 14336)
    default_shrink, default_expand = choose_tiles(64, 33, in_dim, None), choose_tiles(64, 33, None, widths)
    doubled = patched_choose_tiles(VARIANTS["splits_x2"])(64, 33, in_dim, None)
    assert doubled.in_splits == 2 * default_shrink.in_splits
    assert patched_choose_tiles(VARIANTS["in_128"])(64, 33, in_dim, None).block_in == 128 != default_shrink.block_in
    narrow = patched_choose_tiles(VARIANTS["out_64"])(64, 33, None, widths)
    assert narrow.block_out == 64 != default_expand.block_out
    assert patched_choose_tiles(VARIANTS["warps_8"])(64, 33, None, widths).num_warps == 8


def test_row_tile_variant_reaches_the_backend_work_list():
    """A row-tile variant changes the kernels' tiles and the work list the backend builds for them, and only
    inside its block: the 256 bucket's 147 adapter rows (109 padding rows in slot 0, segment bucket 33)."""
    lora, num_present = make_lora(256, 32, 33, 16, seed=0, adapter_rows=147, num_segments=33)
    assert num_present == 32 and int((lora.token_slot == 0).sum()) == 109 and lora.num_segments == 33
    backend = PallasGPUBackend(interpret=True)
    default_rows = backend.prepare(lora, num_seqs=256).work_block_rows
    with use_variant(VARIANTS["rows_32"]):
        meta = backend.prepare(lora, num_seqs=256)
        tiles = pallas_gpu.choose_tiles(256, 33, None, (14336, 14336))
    assert meta.work_block_rows == tiles.block_rows == 32 != default_rows
    assert meta.work.num_items == 256 // 32 + 33 - 1
    assert (
        backend.prepare(lora, num_seqs=256).work_block_rows
        == default_rows
        == choose_tiles(256, 33, 4096, None).block_rows
    )


def test_out_steps_variant_leaves_shrink_alone():
    one_step = patched_choose_tiles(VARIANTS["steps_1"])
    assert (
        one_step(256, 33, None, (14336, 14336)).out_steps == 1 < choose_tiles(256, 33, None, (14336, 14336)).out_steps
    )
    assert one_step(256, 33, 4096, None) == choose_tiles(256, 33, 4096, None)
