"""PallasGPUBackend.prepare: the step's metadata holds what the Triton kernels and the fused GEMM read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sgmv.work_list import gpu_block_rows
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend, PallasGPUMeta, entry_table, prepare_on_host
from sgl_jax_lora.lora.lora_batch import build_lora_batch


def batch(num_tokens: int):
    token_slot = np.array([2, 0, 1, 1, 2, 0, 3, 3], np.int32)[np.arange(num_tokens) % 8]
    return build_lora_batch(token_slot, 8, np.ones(4, np.float32), np.full(4, 16, np.int32))


def test_prepare_builds_the_work_list_of_the_buckets_row_tiles():
    """In jit, the same work list and padded perm as built on the host; no entry table below the fused buckets."""
    lora = batch(35)
    meta = jax.jit(lambda lora: PallasGPUBackend(None, interpret=True).prepare(lora, num_seqs=4))(lora)
    host = prepare_on_host(lora, gpu_block_rows(35))
    assert isinstance(meta, PallasGPUMeta) and meta.work_block_rows == host.work_block_rows == gpu_block_rows(35)
    assert meta.entries is None and not meta.runs_base_gemm
    for got, want in zip(jax.tree.leaves((meta.work, meta.work_perm)), jax.tree.leaves((host.work, host.work_perm))):
        assert np.array_equal(np.asarray(got), want)
    assert meta.batch.token_slot.shape == (35,)


def test_decode_buckets_take_row_tiles_of_16_prefill_buckets_64():
    """Decode rows of many adapters hold a few rows per adapter: every bucket up to 1024 tokens takes the least row
    tile, and prepare builds the step's work list for it; the prefill buckets take 64."""
    assert [gpu_block_rows(t) for t in (1, 64, 256, 512, 768, 1024, 2048, 4096)] == [16] * 6 + [64, 64]
    meta = jax.jit(lambda lora: PallasGPUBackend(None, interpret=True).prepare(lora, num_seqs=4))(batch(1024))
    assert meta.work_block_rows == 16 and meta.work_perm.shape[0] % 16 == 0


def test_prepare_adds_the_entry_table_in_fused_gemm_buckets():
    """From fused_gemm_min_tokens (and multiples of the GEMM's row tile), the entry table sized for the bucket's
    sequences; the row tile is static pytree metadata, so it stays a Python int under jit."""
    backend = PallasGPUBackend(None, interpret=True, fused_gemm_min_tokens=256)
    lora = jax.tree_util.tree_map(jnp.asarray, batch(256))

    @jax.jit
    def prepared(lora):
        meta = backend.prepare(lora, num_seqs=4)
        assert isinstance(meta.work_block_rows, int) and isinstance(meta.entries.tile_m, int)
        return meta

    meta = prepared(lora)
    assert meta.runs_base_gemm and meta.entries.tile_m == backend.fused_gemm_tile_rows(256, 8) == 128
    expected = entry_table(lora, 128, 4)
    assert meta.entries.max_entries == expected.max_entries == 256 // 128 + 4 - 1
    for got, want in zip(jax.tree.leaves(meta.entries), jax.tree.leaves(expected)):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    assert not backend.prepare(jax.tree_util.tree_map(jnp.asarray, batch(128)), num_seqs=4).runs_base_gemm


def test_hopper_default_runs_the_fused_gemm_from_the_1024_bucket():
    """The default thresholds on Hopper GPUs (docs/lora_backends.md "The LoRA inside the base GEMM (prefill, Hopper
    GPUs)"): the 1024 bucket and larger run gate|up's LoRA inside its base GEMM, the 2048 bucket and larger every
    module's, the decode buckets up to 512 (768 and 384 too) the SGMV kernels beside the base GEMM, and a bucket
    off the 128-row tile never does."""
    backend = PallasGPUBackend(
        None,
        interpret=True,
        fused_gemm_min_tokens=PallasGPUBackend.FUSED_GEMM_MIN_TOKENS,
        fused_gemm_other_min_tokens=PallasGPUBackend.FUSED_GEMM_OTHER_MIN_TOKENS,
    )
    buckets = (256, 384, 512, 768, 1024, 1152, 2048)
    assert [backend.fused_gemm_tile_rows(t, 33) for t in buckets] == [0, 0, 0, 0, 128, 128, 128]
    assert [backend.takes_fused_gemm(t, 2, False) for t in buckets] == [False] * 4 + [True] * 3
    for parts, row_parallel in ((3, False), (1, True)):  # q|k|v; o and down
        assert [backend.takes_fused_gemm(t, parts, row_parallel) for t in buckets] == [False] * 6 + [True]
    assert backend.fused_gemm_tile_rows(1000, 33) == 0


def test_entry_table_with_max_chunks_is_bounded_by_adapter_runs():
    """With the engine's --max-prefill-seqs the table holds T / tile + (adapter slots + chunks) - 1 entries, not one a
    sequence of the bucket: a decode step of 1024 rows grouped by slot (32 adapters, base and padding rows after them)
    gets the same entries as the sequence-bounded table, in 8 + 48 - 1 rows of the layout instead of 8 + 1024 - 1."""
    rng = np.random.default_rng(0)
    token_slot = np.sort(rng.integers(1, 33, 751)).astype(np.int32)
    token_slot = np.concatenate([token_slot, np.zeros(1024 - 751, np.int32)])
    scale = np.ones(33, np.float32)
    scale[0] = 0
    lora = jax.tree_util.tree_map(
        jnp.asarray, build_lora_batch(token_slot, 33, scale, np.full(33, 16, np.int32), max_chunks=16)
    )
    wide = entry_table(lora, 128, 1024)
    tight = jax.jit(
        lambda lora: PallasGPUBackend(None, interpret=True, fused_gemm_min_tokens=1024).prepare(lora, 1024, 16)
    )(lora).entries
    assert wide.max_entries == 8 + 1024 - 1 and tight.max_entries == 8 + 32 + 16 - 1
    used = int(np.asarray(tight.entry_start)[-1])
    assert used == int(np.asarray(wide.entry_start)[-1]) and used <= tight.max_entries
    assert np.array_equal(np.asarray(tight.entry_start), np.asarray(wide.entry_start))
    assert np.array_equal(np.asarray(tight.entry_slot)[:used], np.asarray(wide.entry_slot)[:used])
    rows = np.asarray(wide.row_token)[: used * 128]
    assert np.array_equal(np.asarray(tight.row_token)[: used * 128], rows)
    assert np.all(np.asarray(wide.row_token)[used * 128 :] == 1024)  # the wide table's other rows are empty
