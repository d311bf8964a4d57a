"""TPU K/V write kernel (pallas_kernels/attention/kv_write_tpu.py) against XLA's row scatter.

The kernel runs on CPU in Mosaic interpret mode (DMAs included). Steps are laid out as the engine lays them out:
each sequence's new tokens at consecutive positions of its pages (pages shuffled over the cache), padding tokens on
slot 0 of the scratch page, whose contents are not compared. Where libtpu is installed the kernel also compiles for a
TPU slice (`tpu_compile`), and the compiled program holds no copy of the caches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels.attention.kv_write_tpu import BLOCKS_PER_STEP, max_block_runs, write_block, write_kv_tpu
from sgl_jax_lora.model_executor.tpu_aot import compile_for_tpu, mosaic_kernels, tpu_slice_devices
from tests.support.model_export import has_libtpu


@dataclasses.dataclass(frozen=True)
class Step:
    q_lens: tuple[int, ...]  # each sequence's new tokens
    kv_lens: tuple[int, ...]  # each sequence's tokens, the new ones included
    num_tokens: int = 64  # T, padding included
    num_seqs: int = 8  # S
    page_size: int = 16
    dtype: type = jnp.bfloat16
    num_pages: int = 64
    num_kv_heads: int = 2
    head_dim: int = 128


STEPS = {
    "decode_rows": Step(q_lens=(1,) * 8, kv_lens=(1, 16, 17, 31, 32, 33, 100, 5)),
    "chunks_across_pages": Step(q_lens=(40, 1, 17), kv_lens=(40, 9, 50)),
    "chunk_starting_mid_page": Step(q_lens=(30, 2), kv_lens=(45, 18)),
    "float32_pages_of_8": Step(q_lens=(9, 1, 1, 20), kv_lens=(12, 8, 9, 20), page_size=8, dtype=jnp.float32),
    "fp8_pages_of_32": Step(q_lens=(33, 1), kv_lens=(70, 32), page_size=32, dtype=jnp.float8_e4m3fn),
    # pages of 4 under a 16-row tile: interpret mode writes blocks of 4 (on a TPU the page size must be whole tiles)
    "pages_smaller_than_the_tile": Step(q_lens=(5, 1, 3), kv_lens=(7, 4, 3), page_size=4, dtype=jnp.float32),
    # 40 sequences each starting mid-block: more runs than one grid step's group of blocks
    "many_runs": Step(q_lens=(2,) * 40, kv_lens=(17,) * 40, num_tokens=128, num_seqs=64, num_pages=128),
}


def make_step(step: Step, seed: int = 0):
    """-> (caches, layer, k, v, cache_loc, the real tokens)."""
    rng = np.random.default_rng(seed)
    pages = rng.permutation(np.arange(1, step.num_pages))  # page 0 is scratch
    cache_loc, taken = [], 0
    for q_len, kv_len in zip(step.q_lens, step.kv_lens, strict=True):
        table = pages[taken : taken + -(-kv_len // step.page_size)]
        taken += len(table)
        cache_loc += [
            table[p // step.page_size] * step.page_size + p % step.page_size for p in range(kv_len - q_len, kv_len)
        ]
    real = len(cache_loc)
    assert real <= step.num_tokens and len(step.q_lens) <= step.num_seqs
    cache_loc = np.array(cache_loc + [0] * (step.num_tokens - real), np.int32)
    shape = (3, step.num_kv_heads, step.num_pages * step.page_size, step.head_dim)
    values = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32).astype(step.dtype)  # noqa: E731
    rows = (step.num_tokens, step.num_kv_heads, step.head_dim)
    return values(*shape), values(*shape), jnp.int32(1), values(*rows), values(*rows), jnp.asarray(cache_loc), real


@pytest.mark.parametrize("name", sorted(STEPS))
def test_kernel_matches_xla_scatter(name: str):
    step = STEPS[name]
    k_cache, v_cache, layer, k, v, cache_loc, real = make_step(step)
    write = jax.jit(lambda *a: write_kv_tpu(*a, page_size=step.page_size, num_seqs=step.num_seqs, interpret=True))
    got_k, got_v = write(k_cache, v_cache, layer, k, v, cache_loc)
    for got, cache, rows in ((got_k, k_cache, k), (got_v, v_cache, v)):
        want = cache.at[layer, :, cache_loc[:real]].set(rows[:real])
        scratch = step.page_size  # slots of page 0
        np.testing.assert_array_equal(
            np.asarray(got[:, :, scratch:].astype(jnp.float32)), np.asarray(want[:, :, scratch:].astype(jnp.float32))
        )


def test_runs_past_the_bound_would_be_caught():
    """The bound on a step's runs is what sizes the kernel's entries: the many_runs step needs more than one group of
    BLOCKS_PER_STEP, and a bound one run short would drop a token (the comparison above would fail)."""
    step = STEPS["many_runs"]
    runs = 2 * len(step.q_lens) + 1  # each sequence's two tokens straddle a block boundary, and the padding's run
    assert runs > BLOCKS_PER_STEP
    assert max_block_runs(step.num_tokens, step.num_seqs, write_block(step.dtype, step.page_size, True)) >= runs


def test_page_size_off_the_tile_raises_outside_interpret_mode():
    with pytest.raises(ValueError, match="page_size 8 is not a multiple of 16.*--page-size 16"):
        write_block(jnp.bfloat16, 8, interpret=False)
    assert write_block(jnp.bfloat16, 32, interpret=False) == 16
    assert write_block(jnp.float8_e4m3fn, 32, interpret=False) == 32


@pytest.mark.tpu_compile
@pytest.mark.skipif(not has_libtpu(), reason="libtpu is not installed: pip install -e '.[test]' on Linux x86_64")
@pytest.mark.parametrize(
    "dtype,page_size,num_tokens,num_seqs",
    [(jnp.bfloat16, 16, 64, 64), (jnp.bfloat16, 16, 2048, 16), (jnp.float8_e4m3fn, 32, 512, 16)],
    ids=["bf16-decode", "bf16-prefill", "fp8-mixed"],
)
def test_compiles_for_tpu_without_copying_the_cache(dtype, page_size, num_tokens, num_seqs):
    device = tpu_slice_devices("v5e:2x2")[0]
    replicated = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=replicated)  # noqa: E731
    cache = spec((4, 2, 4096 * page_size, 128), dtype)
    rows = spec((num_tokens, 2, 128), dtype)

    def write(k_cache, v_cache, layer, k, v, cache_loc):
        return write_kv_tpu(k_cache, v_cache, layer, k, v, cache_loc, page_size=page_size, num_seqs=num_seqs)

    lowered = jax.jit(write, donate_argnums=(0, 1)).lower(
        cache, cache, spec((), jnp.int32), rows, rows, spec((num_tokens,), jnp.int32)
    )
    compiled = compile_for_tpu(lowered)
    assert mosaic_kernels(compiled) == 1
    cache_bytes = np.prod(cache.shape) * jnp.dtype(dtype).itemsize
    assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes // 16
    cache_shape = "[" + ",".join(map(str, cache.shape)) + "]"
    assert not [line for line in compiled.as_text().splitlines() if " copy(" in line and cache_shape in line]
