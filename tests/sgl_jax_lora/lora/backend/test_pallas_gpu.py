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
    """The default threshold on Hopper GPUs (docs/lora_backends.md "The LoRA inside the base GEMM (prefill, Hopper
    GPUs)"): the 1024 bucket and larger run the LoRA inside the base GEMM, the decode buckets up to 512 (768 and
    384 too) the SGMV kernels beside the base GEMM, and a bucket off the 128-row tile never does."""
    backend = PallasGPUBackend(None, interpret=True, fused_gemm_min_tokens=PallasGPUBackend.FUSED_GEMM_MIN_TOKENS)
    buckets = (256, 384, 512, 768, 1024, 1152, 2048)
    assert [backend.fused_gemm_tile_rows(t, 33) for t in buckets] == [0, 0, 0, 0, 128, 128, 128]
    assert backend.fused_gemm_tile_rows(1000, 33) == 0
