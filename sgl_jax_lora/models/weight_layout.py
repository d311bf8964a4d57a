"""Host-side (numpy) layout transforms from HF tensors to our packed, shard-major layout.

Used by the weight loader for base weights and by the LoRA memory pool for adapter B matrices, so the two
always agree. `axis` is the output-feature axis of the array being transformed.
"""

from __future__ import annotations

import numpy as np

from sgl_jax_lora.models.model_config import ModelConfig


def kv_head_indices(cfg: ModelConfig, tp_size: int) -> np.ndarray:
    """Which HF kv head each of the K_eff stored kv heads is (shard-major); repeats heads when tp > K."""
    per_shard = cfg.kv_heads_per_shard(tp_size)
    if cfg.num_kv_heads >= tp_size:
        return np.arange(cfg.num_kv_heads)
    return np.array([(shard * cfg.num_kv_heads) // tp_size for shard in range(tp_size) for _ in range(per_shard)])


def replicate_kv_heads(w: np.ndarray, axis: int, cfg: ModelConfig, tp_size: int) -> np.ndarray:
    """[.., K*D, ..] (HF kv heads along `axis`) -> [.., K_eff*D, ..]."""
    heads = kv_head_indices(cfg, tp_size)
    if len(heads) == cfg.num_kv_heads:
        return w
    w = np.moveaxis(w, axis, 0)
    w = w.reshape(cfg.num_kv_heads, cfg.head_dim, *w.shape[1:])[heads]
    return np.moveaxis(w.reshape(len(heads) * cfg.head_dim, *w.shape[2:]), 0, axis)


def pack_shard_major(parts: list[np.ndarray], axis: int, tp_size: int) -> np.ndarray:
    """Concatenate parts along `axis` so each of tp_size equal slices holds every part's local slice."""
    moved = [np.moveaxis(p, axis, 0) for p in parts]
    split = [p.reshape(tp_size, p.shape[0] // tp_size, *p.shape[1:]) for p in moved]
    packed = np.concatenate(split, axis=1)
    packed = packed.reshape(packed.shape[0] * packed.shape[1], *packed.shape[2:])
    return np.moveaxis(packed, 0, axis)
