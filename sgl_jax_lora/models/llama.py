"""Llama-family decoder (Llama-2/3, Mistral; Qwen2 adds qkv bias, Qwen3 adds per-head q/k RMSNorm).

Flow: ModelRunner calls `model(kv_cache, forward_batch)` inside jit -> embeddings -> a lax.scan over the
stacked decoder layers (one compiled layer body, weights [L, ...]) -> final norm -> hidden [T, E].
`model.logits(hidden)` applies the LM head to the rows the sampler needs. A model with sliding windows (Mistral;
Qwen2 and Qwen3 with `use_sliding_window`) hands each layer its window, indexed by the loop's layer. In token
buckets that run the base GEMM kernel (`base_gemm`, layers/base_gemm.py: `--gpu-gemm-min-tokens`), the layers' base
weights stay whole [L, ...] stacks outside the scan, as the LoRA buffers always do (see `__call__`).

Linears are packed (qkv_proj <- q, k, v; gate_up_proj <- gate, up) in shard-major layout
(layers/linear.py); which HF modules each packed linear carries is LORA_TARGETS (lora/target_shapes.py). Two
tables beside the layers: LINEAR_AXES (the logical axes of each linear's weights, declared on its parameters; layers/sharding.py maps
them to mesh axes) and HF_WEIGHTS (the HF tensors each parameter is made from; models/weight_loader.py
walks it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.attention import (
    AttentionBackend,
    fuses_rope_kv_write,
    layer_windows,
    paged_attention,
    plan_attention,
    rotate_and_write_kv,
    write_kv,
)
from sgl_jax_lora.layers.base_gemm import BaseGemm
from sgl_jax_lora.layers.fp8 import Fp8Gemm
from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.layers.linear import BaseKernel, Fp8Kernel, Fp8Scale, Linear, LinearAxes, split_packed
from sgl_jax_lora.layers.norm import RMSNorm
from sgl_jax_lora.layers.rotary import inverse_frequencies, rotary_tables, rotate
from sgl_jax_lora.layers.weight_layout import LAYER, HFWeight
from sgl_jax_lora.lora.backend.base import LoRAMeta
from sgl_jax_lora.lora.lora_linear import LoRABaseKernel, LoRALinear, LoRAModelSpec, LoRAWeight
from sgl_jax_lora.lora.target_shapes import LORA_TARGETS
from sgl_jax_lora.mem_cache.kv_cache import KVCache
from sgl_jax_lora.models.forward_batch import ForwardBatch

_PART_NAMES = {"qkv_proj": ("q", "k", "v"), "o_proj": ("",), "gate_up_proj": ("gate", "up"), "down_proj": ("",)}

# Linear -> logical axes of its weights: (in, packed out, each part's out). Column-parallel linears split
# their output features, row-parallel ones their input features (layers/sharding.py SHARDING_RULES).
LINEAR_AXES: dict[str, LinearAxes] = {
    "qkv_proj": LinearAxes("embed", "qkv", ("heads", "kv_heads", "kv_heads")),
    "o_proj": LinearAxes("heads", "embed", ("embed",)),
    "gate_up_proj": LinearAxes("embed", "mlp", ("mlp", "mlp")),
    "down_proj": LinearAxes("mlp", "embed", ("embed",)),
    "lm_head": LinearAxes("embed", "vocab", ("vocab",)),
}

_ATTN, _MLP = f"model.layers.{LAYER}.self_attn", f"model.layers.{LAYER}.mlp"

# Our parameter path (layer-stacked parameters under "layers") -> the HF tensors it is made from.
# Parameters a config leaves out (qkv bias without Qwen2, q/k norms without Qwen3, lm_head when tied) are
# simply absent from the model, so their rows go unused.
HF_WEIGHTS: dict[str, HFWeight] = {
    "embed_tokens.embedding": HFWeight(("model.embed_tokens.weight",)),
    "norm.scale": HFWeight(("model.norm.weight",)),
    "lm_head.kernel": HFWeight(("lm_head.weight",), transpose=True),
    "layers.input_layernorm.scale": HFWeight((f"model.layers.{LAYER}.input_layernorm.weight",)),
    "layers.post_attention_layernorm.scale": HFWeight((f"model.layers.{LAYER}.post_attention_layernorm.weight",)),
    "layers.q_norm.scale": HFWeight((f"{_ATTN}.q_norm.weight",)),
    "layers.k_norm.scale": HFWeight((f"{_ATTN}.k_norm.weight",)),
    "layers.qkv_proj.kernel": HFWeight(
        (f"{_ATTN}.q_proj.weight", f"{_ATTN}.k_proj.weight", f"{_ATTN}.v_proj.weight"), transpose=True, kv_parts=(1, 2)
    ),
    "layers.qkv_proj.bias": HFWeight(
        (f"{_ATTN}.q_proj.bias", f"{_ATTN}.k_proj.bias", f"{_ATTN}.v_proj.bias"), kv_parts=(1, 2)
    ),
    "layers.o_proj.kernel": HFWeight((f"{_ATTN}.o_proj.weight",), transpose=True),
    "layers.gate_up_proj.kernel": HFWeight((f"{_MLP}.gate_proj.weight", f"{_MLP}.up_proj.weight"), transpose=True),
    "layers.down_proj.kernel": HFWeight((f"{_MLP}.down_proj.weight",), transpose=True),
}


def _make_linear(
    name: str,
    in_features: int,
    part_sizes: tuple[int, ...],
    tp_size: int,
    use_bias: bool,
    dtype,
    lora: LoRAModelSpec | None,
    base_gemm: BaseGemm | None,
    fp8: Fp8Gemm | None,
) -> Linear:
    axes = LINEAR_AXES[name]
    if lora is None or name not in lora.target_modules:
        return Linear(in_features, part_sizes, tp_size, use_bias, dtype, axes, base_gemm, fp8)
    row_parallel = LORA_TARGETS[name][1]
    parts = _PART_NAMES[name]
    return LoRALinear(
        in_features, part_sizes, parts, tp_size, use_bias, dtype, lora, row_parallel, axes, base_gemm, fp8
    )


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp_size: int,
        page_size: int,
        dtype,
        lora: LoRAModelSpec | None,
        attention_backend: AttentionBackend,
        base_gemm: BaseGemm | None = None,
        fp8: Fp8Gemm | None = None,
    ):
        kv_heads = cfg.kv_heads_per_shard(tp_size) * tp_size  # replicated when tp > num_kv_heads
        head_dim, hidden = cfg.head_dim, cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, kv_heads, head_dim
        self.tp_size, self.page_size, self.attention_backend = tp_size, page_size, attention_backend
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, "embed")
        qkv_sizes = (cfg.num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        linear = dict(tp_size=tp_size, dtype=dtype, lora=lora, base_gemm=base_gemm, fp8=fp8)
        self.qkv_proj = _make_linear("qkv_proj", hidden, qkv_sizes, use_bias=cfg.qkv_bias, **linear)
        self.o_proj = _make_linear("o_proj", cfg.num_heads * head_dim, (hidden,), use_bias=False, **linear)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype, "head_dim") if cfg.qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype, "head_dim") if cfg.qk_norm else None
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, "embed")
        mlp = cfg.intermediate_size
        self.gate_up_proj = _make_linear("gate_up_proj", hidden, (mlp, mlp), use_bias=False, **linear)
        self.down_proj = _make_linear("down_proj", mlp, (hidden,), use_bias=False, **linear)

    def __call__(
        self,
        hidden: jax.Array,
        kv: KVCache,
        layer: jax.Array,
        batch: ForwardBatch,
        lora: LoRAMeta | None,
        rotary: tuple[jax.Array, jax.Array],
        attention_plan=None,
        sliding_window: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """hidden [T, E] -> [T, E]; writes this step's K/V of layer `layer` into kv. lora: the LoRA backend's
        metadata for the step (None: no token uses an adapter); rotary: the forward's (cos, sin) tables;
        attention_plan: the forward's attention layout (layers/attention.py `plan_attention`; None: per call);
        sliding_window: [] i32, this layer's window (None: the model has none)."""
        num_tokens = hidden.shape[0]
        rows = batch.cu_q_lens[-1:]  # the step's real tokens: the GEMM kernels skip the padding's row tiles after them
        x = self.input_layernorm(hidden)
        # the padding rows of q|k|v zeroed by the projection, unless the fused kernel masks them itself
        qkv = self.qkv_proj(x, lora, num_rows=rows, zero_padding=not self.qkv_to_rope_kv_kernel)
        q, k_cache, v_cache = self._rotated_q_and_kv_write(qkv, kv, layer, batch, rotary, rows)
        attn = paged_attention(
            q,
            k_cache,
            v_cache,
            layer,
            batch.seq_lens,
            batch.page_table,
            batch.cu_q_lens,
            self.page_size,
            self.head_dim**-0.5,
            self.attention_backend,
            plan=attention_plan,
            sliding_window=sliding_window,
        )
        hidden = self.o_proj(attn.reshape(num_tokens, -1), lora, residual=hidden, num_rows=rows)
        x = self.post_attention_layernorm(hidden)
        activation = self.gate_up_proj.silu_and_mul(x, lora, num_rows=rows)
        hidden = self.down_proj(activation, lora, residual=hidden, num_rows=rows)
        return hidden, KVCache(k=k_cache, v=v_cache)

    @property
    def qkv_to_rope_kv_kernel(self) -> bool:
        """Whether this layer's q|k|v output goes to the one GPU kernel that rotates q and k and writes K/V
        (layers/attention.py `rotate_and_write_kv`): on the GPU attention backend, for head dims that kernel takes,
        in models without q/k norms (they normalize between the GEMM and the rotary). That kernel masks the
        bucket's padding rows itself, so the q|k|v projection then leaves them unzeroed (`zero_padding=False`),
        saving the select XLA could not fuse into a Pallas call (a pass over [T, (H + 2K) * D] per layer)."""
        return self.q_norm is None and fuses_rope_kv_write(self.attention_backend, self.head_dim)

    def _rotated_q_and_kv_write(
        self,
        qkv: jax.Array,
        kv: KVCache,
        layer: jax.Array,
        batch: ForwardBatch,
        rotary: tuple[jax.Array, jax.Array],
        num_rows: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The packed q|k|v output -> (q rotated [T, H, D], the caches holding this step's k rotated and v): one GPU
        kernel where `qkv_to_rope_kv_kernel` (qkv's rows from num_rows[0] on may then hold any values: the kernel
        zeroes their q and writes none of their k and v), else XLA's rotary then `write_kv` (qkv's padding rows
        zero or computed)."""
        if self.qkv_to_rope_kv_kernel:
            args = (qkv, kv.k, kv.v, layer, rotary, batch.cache_loc, self.num_heads)
            return rotate_and_write_kv(*args, self.attention_backend, num_rows=num_rows)
        num_tokens = qkv.shape[0]
        q, k, v = split_packed(qkv, self.qkv_proj.part_sizes, self.tp_size)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, *rotary), rotate(k, *rotary)
        num_seqs = batch.seq_lens.shape[0]
        k_cache, v_cache = write_kv(
            kv.k, kv.v, layer, k, v, batch.cache_loc, self.attention_backend, self.page_size, num_seqs
        )
        return q, k_cache, v_cache


class LlamaForCausalLM(nnx.Module):
    hf_weights = HF_WEIGHTS  # the table models/weight_loader.py reads HF checkpoints through

    def __init__(
        self,
        cfg: ModelConfig,
        tp_size: int,
        page_size: int,
        dtype,
        lora: LoRAModelSpec | None = None,
        layers_per_scan_step: int = 1,
        attention_backend: AttentionBackend = AttentionBackend(),
        base_gemm: BaseGemm | None = None,
        fp8: Fp8Gemm | None = None,
        in_place_layers_per_scan_step: int | None = None,
    ):
        """base_gemm: the base GEMM kernel's setting (layers/base_gemm.py make_base_gemm; None: XLA's dot always).
        fp8: the decoder layers' linears in 8-bit floats (layers/fp8.py make_fp8_gemm; None: in `dtype`).
        layers_per_scan_step: the layer loop's unroll; in_place_layers_per_scan_step: its unroll in the token buckets
        that read every decoder linear's weight in place from its stack (None: layers_per_scan_step)."""
        self.config = cfg
        self.base_gemm = base_gemm
        self.lora_backend = lora.backend if lora is not None else None  # prepares its metadata per forward
        self.attention_backend = attention_backend  # plans the step's attention layout once per forward
        self.attention_group = cfg.num_heads // (cfg.kv_heads_per_shard(tp_size) * tp_size)  # q heads per kv head
        self.layers_per_scan_step = layers_per_scan_step  # lax.scan unroll: num_layers = a straight-line program
        self.in_place_layers_per_scan_step = in_place_layers_per_scan_step or layers_per_scan_step
        self.weights_always_in_place = fp8 is not None  # the fp8 kernel reads the 8-bit stacks in every bucket
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        # the rotary inverse frequencies: the forward turns them into tables once and hands those to every layer
        self.inv_freq = tuple(float(f) for f in inverse_frequencies(cfg.rope, cfg.head_dim))
        self.rotary_scale = cfg.rope.attention_factor

        # every parameter's declared logical axes gain the leading "layers" axis of the stack
        @nnx.vmap(
            in_axes=None,
            out_axes=0,
            axis_size=cfg.num_layers,
            transform_metadata={nnx.PARTITION_NAME: "layers", "logical_axes": "layers"},
        )
        def make_layers(_: int):
            return DecoderLayer(cfg, tp_size, page_size, dtype, lora, attention_backend, base_gemm, fp8)

        self.layers = make_layers(0)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, "embed")
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, (cfg.vocab_size,), tp_size, False, dtype, LINEAR_AXES["lm_head"])
        )

    def __call__(self, kv: KVCache, batch: ForwardBatch) -> tuple[jax.Array, KVCache]:
        """-> (final-normed hidden [T, E], updated kv)."""
        hidden = self.embed_tokens(batch.input_ids)
        lora = None
        if batch.lora is not None and self.lora_backend is not None:  # once per forward, shared by every layer
            num_seqs, max_chunks = batch.seq_lens.shape[0], self.attention_backend.max_chunks
            lora = self.lora_backend.prepare(batch.lora, num_seqs=num_seqs, max_chunks=max_chunks)
        # LoRA buffers (and, when the backend runs the base GEMM with the LoRA inside it, the LoRA modules' base
        # weights; in buckets that run the base GEMM kernel, every layer linear's base weight) stay whole [L, ...]
        # arrays outside the scan: each layer gets LayerStack views (layers/layer_stack.py), so kernels that read the
        # stack in place never copy a layer's slot pool or weight
        stacked = (LoRAWeight, Fp8Kernel, Fp8Scale)  # 8-bit weights (--quantization fp8) and their scales: the fp8
        # kernel reads both in place
        weights_in_place = self.weights_always_in_place
        if self.base_gemm is not None and self.base_gemm.runs(batch.input_ids.shape[0]):
            stacked = (*stacked, BaseKernel)  # LoRABaseKernel is a BaseKernel
            weights_in_place = True
        elif lora is not None and lora.runs_base_gemm:
            stacked = (*stacked, LoRABaseKernel)
        layer_def, stacked_state, layer_state = nnx.split(self.layers, stacked, ...)
        rotary = rotary_tables(batch.positions, self.inv_freq, self.rotary_scale)  # once per forward, for every layer
        # once per forward too: every layer's attention runs on the same row layout (a rolled layer loop would
        # otherwise derive it again in each iteration)
        attention_plan = plan_attention(
            self.attention_backend,
            batch.seq_lens,
            batch.page_table,
            batch.cu_q_lens,
            batch.input_ids.shape[0],
            self.attention_group,
            hidden.dtype,  # q's: the projections keep the hidden stream's dtype
            batch.decode_only,
        )

        windows = layer_windows(self.config.sliding_windows)

        def body(carry, xs):
            h, cache = carry
            state, layer = xs
            views = jax.tree.map(lambda stack: LayerStack(stack, layer), stacked_state)
            window = None if windows is None else windows[layer]
            decoder_layer = nnx.merge(layer_def, views, state)
            h, cache = decoder_layer(h, cache, layer, batch, lora, rotary, attention_plan, sliding_window=window)
            return (h, cache), None

        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        # where no layer slices a large weight out of its stack, a rolled loop (one compiled layer body) can cost the
        # host less to launch than a straight-line program of every layer's ops (docs/architecture.md "The layer loop")
        unroll = self.in_place_layers_per_scan_step if weights_in_place else self.layers_per_scan_step
        (hidden, kv), _ = jax.lax.scan(body, (hidden, kv), (layer_state, layer_ids), unroll=unroll)
        return self.norm(hidden), kv

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, E] -> logits [N, V] float32."""
        if self.lm_head is None:
            table = self.embed_tokens.embedding[...]
            return jnp.einsum("ne,ve->nv", hidden, table, preferred_element_type=jnp.float32)
        return jnp.dot(hidden, self.lm_head.kernel[...], preferred_element_type=jnp.float32)


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype):
        self.embedding = nnx.Param(jnp.zeros((vocab_size, hidden_size), dtype), logical_axes=("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids [T] -> [T, E]."""
        return self.embedding[...][ids]
