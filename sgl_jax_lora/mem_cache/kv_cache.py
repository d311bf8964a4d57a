"""The paged KV cache as a pytree that goes into the jitted step and comes back out (donated).

Layout per tensor: [L, K, N, D] (heads before slots: see layers/attention.py) with N = num_pages * page_size slots (slot = page * page_size + offset),
K = kv heads held across the tensor axis (replicated copies when tp > num_kv_heads), sharded on K.
Page 0 is scratch: padding tokens write there and the allocator never hands it out.
The cache holds the model's dtype, or 8-bit floats (`kv_cache_dtype`, --kv-cache-dtype fp8_e4m3 / fp8_e5m2): K/V
are saturated and cast as they are written (layers/attention.py `write_kv`), with no scale, and widened again as
the attention reads them (pallas_kernels/attention).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.sharding import logical_to_sharding


@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, K, N, D]
    v: jax.Array  # [L, K, N, D]


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v"], meta_fields=[])

KV_LOGICAL_AXES = ("layers", "kv_heads", "kv_slots", "head_dim")
FP8_KV_DTYPES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}  # --kv-cache-dtype -> 8-bit dtype


def kv_cache_dtype(flag: str, model_dtype) -> jnp.dtype:
    """--kv-cache-dtype -> the cache's dtype: 'auto' keeps the model's dtype."""
    if flag == "auto":
        return jnp.dtype(model_dtype)
    if flag not in FP8_KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype '{flag}' is not supported; choose auto, {' or '.join(FP8_KV_DTYPES)}")
    return jnp.dtype(FP8_KV_DTYPES[flag])


def kv_bytes_per_token(cfg: ModelConfig, tp_size: int, dtype: jnp.dtype) -> int:
    """Bytes one token's K and V take over all layers (summed over devices)."""
    kv_heads = cfg.kv_heads_per_shard(tp_size) * tp_size
    return 2 * cfg.num_layers * kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def abstract_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, tp_size: int, dtype, mesh: Mesh) -> KVCache:
    """The cache's shapes, dtype and sharding, with no memory behind them: the forward programs compile against it
    before the cache takes the device memory (XLA's autotuner allocates buffers while it compiles)."""
    kv_heads = cfg.kv_heads_per_shard(tp_size) * tp_size
    shape = (cfg.num_layers, kv_heads, num_pages * page_size, cfg.head_dim)
    tensor = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=logical_to_sharding(mesh, KV_LOGICAL_AXES))
    return KVCache(k=tensor, v=tensor)


def allocate_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, tp_size: int, dtype, mesh: Mesh) -> KVCache:
    tensor = abstract_kv_cache(cfg, num_pages, page_size, tp_size, dtype, mesh).k
    zeros = jax.jit(lambda: jnp.zeros(tensor.shape, tensor.dtype), out_shardings=tensor.sharding)
    return KVCache(k=zeros(), v=zeros())
