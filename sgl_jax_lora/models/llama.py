"""Llama-family decoder (Llama-2/3, Mistral; Qwen2 adds qkv bias, Qwen3 adds per-head q/k RMSNorm).

Flow: ModelRunner calls `model(kv_cache, forward_batch)` inside jit -> embeddings -> a lax.scan over the
stacked decoder layers (one compiled layer body, weights [L, ...]) -> final norm -> hidden [T, E].
`model.logits(hidden)` applies the LM head to the rows the sampler needs.

Linears are packed (qkv_proj <- q, k, v; gate_up_proj <- gate, up) in shard-major layout
(layers/linear.py). LORA_TARGETS is the table of which HF modules each packed linear carries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax_lora.layers.attention import AttentionBackend, paged_attention, write_kv
from sgl_jax_lora.layers.linear import Linear, split_packed
from sgl_jax_lora.layers.norm import RMSNorm
from sgl_jax_lora.layers.rotary import apply_rotary, inverse_frequencies
from sgl_jax_lora.lora.layer_stack import LayerStack
from sgl_jax_lora.lora.lora_batch import with_entry_table, with_work_list
from sgl_jax_lora.lora.lora_linear import LoRABaseKernel, LoRALinear, LoRAModelSpec, LoRAWeight
from sgl_jax_lora.mem_cache.kv_cache import KVCache
from sgl_jax_lora.model_executor.forward_batch import ForwardBatch
from sgl_jax_lora.models.model_config import ModelConfig

# Packed linear -> (HF modules it carries, row-parallel?)
LORA_TARGETS: dict[str, tuple[tuple[str, ...], bool]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), False),
    "o_proj": (("o_proj",), True),
    "gate_up_proj": (("gate_proj", "up_proj"), False),
    "down_proj": (("down_proj",), True),
}
_PART_NAMES = {"qkv_proj": ("q", "k", "v"), "o_proj": ("",), "gate_up_proj": ("gate", "up"), "down_proj": ("",)}


def _make_linear(
    name: str, in_features: int, part_sizes: tuple[int, ...], tp_size: int, use_bias: bool, dtype, lora: LoRAModelSpec | None
) -> Linear:
    if lora is None or name not in lora.target_modules:
        return Linear(in_features, part_sizes, tp_size, use_bias, dtype)
    row_parallel = LORA_TARGETS[name][1]
    return LoRALinear(in_features, part_sizes, _PART_NAMES[name], tp_size, use_bias, dtype, lora, row_parallel)


class DecoderLayer(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, tp_size: int, page_size: int, dtype, lora: LoRAModelSpec | None,
        attention_backend: AttentionBackend,
    ):
        kv_heads = cfg.kv_heads_per_shard(tp_size) * tp_size  # replicated when tp > num_kv_heads
        head_dim, hidden = cfg.head_dim, cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, kv_heads, head_dim
        self.tp_size, self.page_size, self.attention_backend = tp_size, page_size, attention_backend
        self.inv_freq = tuple(float(f) for f in inverse_frequencies(cfg.rope, head_dim))
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        qkv_sizes = (cfg.num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        self.qkv_proj = _make_linear("qkv_proj", hidden, qkv_sizes, tp_size, cfg.qkv_bias, dtype, lora)
        self.o_proj = _make_linear("o_proj", cfg.num_heads * head_dim, (hidden,), tp_size, False, dtype, lora)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        mlp = cfg.intermediate_size
        self.gate_up_proj = _make_linear("gate_up_proj", hidden, (mlp, mlp), tp_size, False, dtype, lora)
        self.down_proj = _make_linear("down_proj", mlp, (hidden,), tp_size, False, dtype, lora)

    def __call__(
        self, hidden: jax.Array, kv: KVCache, layer: jax.Array, batch: ForwardBatch
    ) -> tuple[jax.Array, KVCache]:
        """hidden [T, E] -> [T, E]; writes this step's K/V of layer `layer` into kv."""
        num_tokens = hidden.shape[0]
        x = self.input_layernorm(hidden)
        qkv = self.qkv_proj(x, batch.lora)
        q, k, v = split_packed(qkv, self.qkv_proj.part_sizes, self.tp_size)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, batch.positions, self.inv_freq)
        k = apply_rotary(k, batch.positions, self.inv_freq)
        k_cache, v_cache = write_kv(kv.k, kv.v, layer, k, v, batch.cache_loc)
        attn = paged_attention(q, k_cache, v_cache, layer, batch, self.page_size, self.head_dim**-0.5, self.attention_backend)
        hidden = self.o_proj(attn.reshape(num_tokens, -1), batch.lora, residual=hidden)
        x = self.post_attention_layernorm(hidden)
        gate, up = split_packed(self.gate_up_proj(x, batch.lora), self.gate_up_proj.part_sizes, self.tp_size)
        hidden = self.down_proj(jax.nn.silu(gate) * up, batch.lora, residual=hidden)
        return hidden, KVCache(k=k_cache, v=v_cache)


class LlamaForCausalLM(nnx.Module):
    def __init__(
        self, cfg: ModelConfig, tp_size: int, page_size: int, dtype, lora: LoRAModelSpec | None = None,
        layers_per_scan_step: int = 1, attention_backend: AttentionBackend = AttentionBackend(),
    ):
        self.config = cfg
        self.lora_backend = lora.backend if lora is not None else None  # builds the kernels' work list per forward
        self.layers_per_scan_step = layers_per_scan_step  # lax.scan unroll: num_layers = a straight-line program
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)

        @nnx.vmap(in_axes=None, out_axes=0, axis_size=cfg.num_layers)
        def make_layers(_: int):
            return DecoderLayer(cfg, tp_size, page_size, dtype, lora, attention_backend)

        self.layers = make_layers(0)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, (cfg.vocab_size,), tp_size, False, dtype)

    def __call__(self, kv: KVCache, batch: ForwardBatch) -> tuple[jax.Array, KVCache]:
        """-> (final-normed hidden [T, E], updated kv)."""
        hidden = self.embed_tokens(batch.input_ids)
        fused_rows = 0
        if batch.lora is not None and self.lora_backend is not None:  # once per forward, shared by every layer
            num_tokens, num_segments = batch.lora.token_slot.shape[0], batch.lora.num_segments
            block_rows = self.lora_backend.work_block_rows(num_tokens, num_segments)
            fused_rows = self.lora_backend.fused_gemm_tile_rows(num_tokens, num_segments)
            lora = with_entry_table(with_work_list(batch.lora, block_rows), fused_rows, batch.seq_lens.shape[0])
            batch = dataclasses.replace(batch, lora=lora)
        # LoRA buffers (and, for the GEMM with the LoRA inside it, the LoRA modules' base weights) stay whole
        # [L, ...] arrays outside the scan: each layer gets LayerStack views (lora/layer_stack.py), so kernels
        # that read the stack in place never copy a layer's slot pool or weight
        stacked = (LoRAWeight, LoRABaseKernel) if fused_rows else LoRAWeight
        layer_def, stacked_state, layer_state = nnx.split(self.layers, stacked, ...)

        def body(carry, xs):
            h, cache = carry
            state, layer = xs
            views = jax.tree.map(lambda stack: LayerStack(stack, layer), stacked_state)
            h, cache = nnx.merge(layer_def, views, state)(h, cache, layer, batch)
            return (h, cache), None

        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        (hidden, kv), _ = jax.lax.scan(body, (hidden, kv), (layer_state, layer_ids), unroll=self.layers_per_scan_step)
        return self.norm(hidden), kv

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, E] -> logits [N, V] float32."""
        if self.lm_head is None:
            table = self.embed_tokens.embedding[...]
            return jnp.einsum("ne,ve->nv", hidden, table, preferred_element_type=jnp.float32)
        return jnp.dot(hidden, self.lm_head.kernel[...], preferred_element_type=jnp.float32)


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype):
        self.embedding = nnx.Param(jnp.zeros((vocab_size, hidden_size), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids [T] -> [T, E]."""
        return self.embedding[...][ids]
