"""The KV cache placed on the devices at startup, shrunk until it fits where its size came from memory.

Where it sits: called by ModelRunner.place_kv_cache (model_executor/model_runner.py) once the forwards compiled,
after model_executor/step_memory.py sized the cache; mem_cache/kv_cache.py allocates it. An allocation fails on
the device asynchronously and would otherwise surface at the first forward, so the cache is checked here.

A cache sized from device memory can still fail to be placed: with XLA_PYTHON_CLIENT_PREALLOCATE=false, K and V of
47.8 GB each did not both fit under an H200's 112.6 GB limit (the GPU allocator seems to grow in regions rounded up
to powers of two). Such a cache is shrunk by KV_SHRINK_FACTOR until it fits, KV_ALLOCATION_ATTEMPTS times at most; a
size the user set (--max-total-tokens) is not changed: it fails with the fix named.

What exists here: `place_kv_cache`, `KV_ALLOCATION_ATTEMPTS`, `KV_SHRINK_FACTOR`.
"""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.mem_cache.kv_cache import KVCache, allocate_kv_cache, kv_bytes_per_token

logger = logging.getLogger(__name__)
KV_ALLOCATION_ATTEMPTS = 8  # a cache sized from memory shrinks this many times at most before startup fails
KV_SHRINK_FACTOR = 0.9


def place_kv_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, tp_size: int, kv_dtype, mesh: Mesh | None, may_shrink: bool
) -> tuple[KVCache, int]:
    """The cache of `num_pages` pages (scratch page 0 included) on the devices, ready -> (the cache, its pages):
    fewer pages where `may_shrink` (a size from memory) and the devices refused the first size; MemoryError, naming
    the flags to change, where no size fits."""
    shrinks_left = KV_ALLOCATION_ATTEMPTS - 1 if may_shrink else 0
    while True:
        try:
            kv = jax.block_until_ready(allocate_kv_cache(cfg, num_pages, page_size, tp_size, kv_dtype, mesh))
            return kv, num_pages
        except jax.errors.JaxRuntimeError as err:  # the part of the cache that was placed is freed with it
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            tokens = (num_pages - 1) * page_size
            gigabytes = tokens * kv_bytes_per_token(cfg, tp_size, kv_dtype) / 1e9
            smaller = max(2, int((num_pages - 1) * KV_SHRINK_FACTOR)) + 1
            if not shrinks_left or smaller >= num_pages:  # the user's size, or no page left to give up
                raise MemoryError(
                    f"the KV cache of {tokens} tokens ({gigabytes:.1f} GB over {tp_size} device(s)) does not fit in "
                    f"device memory ({str(err).splitlines()[0][:200]}); lower --max-total-tokens or "
                    "--mem-fraction-static"
                ) from None
        shrinks_left, num_pages = shrinks_left - 1, smaller
        logger.warning(
            "KV cache of %d tokens (%.1f GB) could not be placed on the devices; retrying with %d tokens (the forward "
            "programs compile again for its shape)",
            tokens,
            gigabytes,
            (num_pages - 1) * page_size,
        )
