"""Host-side (numpy) layout transforms from HF tensors to our packed, shard-major layout.

Used by the weight loader for base weights and by the LoRA memory pool for adapter B matrices, so the two
always agree. `axis` is the output-feature axis of the array being transformed.

HFWeight is one row of a model's table of HF weight names (models/llama.py HF_WEIGHTS): which HF tensors make
one of our parameters and how (transposed, kv heads replicated, packed); models/weight_loader.py walks it.

Where it sits: layers, beside the packed linears (layers/linear.py) whose layout it produces; below the LoRA
memory pool (lora/memory_pool.py) and the models, which both lay weights out through it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sgl_jax_lora.configs.model_config import ModelConfig


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


LAYER = "{layer}"  # stands for the decoder layer index in an HF tensor name


@dataclasses.dataclass(frozen=True)
class HFWeight:
    """How one of our parameters is made from HF tensors. Names holding LAYER are read once per decoder
    layer and stacked [L, ...]; two or more names are packed shard-major along the output features."""

    names: tuple[str, ...]  # HF tensor names, in packing order (q, k, v; gate, up)
    transpose: bool = False  # HF linears are [out, in]; ours are [in, out]
    kv_parts: tuple[int, ...] = ()  # positions in `names` of k and v (their heads repeat when tp > num_kv_heads)

    @property
    def per_layer(self) -> bool:
        return LAYER in self.names[0]

    def tensor_names(self, num_layers: int) -> list[tuple[str, ...]]:
        """The HF names to read: one tuple per decoder layer, or a single tuple for a whole-model tensor."""
        if not self.per_layer:
            return [self.names]
        return [tuple(name.replace(LAYER, str(layer)) for name in self.names) for layer in range(num_layers)]

    def to_ours(self, tensors: list[np.ndarray], cfg: ModelConfig, tp_size: int) -> np.ndarray:
        """The HF tensors of `names` (one layer's) -> our layout; the output features are the last axis."""
        parts = [t.T if self.transpose else t for t in tensors]
        parts = [
            replicate_kv_heads(p, p.ndim - 1, cfg, tp_size) if i in self.kv_parts else p for i, p in enumerate(parts)
        ]
        if len(parts) == 1:
            return parts[0]
        return pack_shard_major(parts, parts[0].ndim - 1, tp_size)
