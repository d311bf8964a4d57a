"""The training forward: the serving model's own weights, no paged KV cache, LoRA A/B as a separate pytree.

Flow: LoRATrainer (trainer.py) holds (graphdef, base_state) of the same Flax NNX Llama-family model the engine
builds (models/weight_loader.py, without LoRA buffers) and the trainable `LoRAParams` (lora_params.py). Each step
calls `token_logprobs(graphdef, base_state, lora, input_ids)` inside jit and differentiates w.r.t. `lora` only:
the base weights are arguments, never copied into the trainable state, and get no gradients.

Per layer (a lax.scan over the stacked layers, as the serving model runs them), every projection is the module's
own base GEMM plus the LoRA delta of each HF module it packs, exactly as PEFT computes it:
    y_m = base_m(x) + (x @ A_m^T) @ B_m^T * scaling          A_m [R, in], B_m [out, R]
Attention is causal over the whole padded sequence [B, S] (right padding: a pad key is never before a real query),
within each layer's sliding window where the model has one (ModelConfig.sliding_windows); on GPU in bf16/fp16 it is
cuDNN's flash attention, unless the model mixes windowed and full layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax_lora.layers.attention import layer_windows
from sgl_jax_lora.layers.linear import split_packed
from sgl_jax_lora.layers.rotary import rotary_tables, rotate
from sgl_jax_lora.train.lora_params import LoRAParams


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def frozen_dot(x: jax.Array, kernel: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """x [N, in] @ kernel [in, out] accumulated in float32 -> [N, out] out_dtype, with a frozen kernel: the backward
    pass gives x its gradient only, multiplying in the kernel's dtype (bf16 on tensor cores). JAX's own transpose
    would multiply the float32 cotangent by the kernel in float32, converting each layer's weights every step."""
    return jnp.dot(x, kernel, preferred_element_type=jnp.float32).astype(out_dtype)


def _frozen_dot_fwd(x: jax.Array, kernel: jax.Array, out_dtype: jnp.dtype) -> tuple[jax.Array, tuple]:
    return frozen_dot(x, kernel, out_dtype), (kernel, jnp.zeros((), x.dtype))  # residuals are arrays: x's dtype


def _frozen_dot_bwd(out_dtype: jnp.dtype, residuals: tuple, cotangent: jax.Array) -> tuple:
    kernel, x_like = residuals
    dx = jnp.dot(cotangent.astype(kernel.dtype), kernel.T, preferred_element_type=jnp.float32)
    return dx.astype(x_like.dtype), None  # None: the base weights get no gradient


frozen_dot.defvjp(_frozen_dot_fwd, _frozen_dot_bwd)


def trainable_dot(x: jax.Array, kernel: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """frozen_dot's product with JAX's own gradients for both operands (full-parameter training)."""
    return jnp.dot(x, kernel, preferred_element_type=jnp.float32).astype(out_dtype)


Dot = Callable[[jax.Array, jax.Array, jnp.dtype], jax.Array]


def _base(linear, x: jax.Array, dot: Dot) -> jax.Array:
    """The serving Linear's base product (layers/linear.py), through `dot`."""
    y = dot(x, linear.kernel[...], x.dtype)
    return y if linear.bias is None else y + linear.bias[...]


def _logits(model, hidden: jax.Array, dot: Dot) -> jax.Array:
    """hidden [N, E] -> logits [N, V] float32, as the serving model's `logits`, through `dot`."""
    kernel = model.embed_tokens.embedding[...].T if model.lm_head is None else model.lm_head.kernel[...]
    return dot(hidden, kernel, jnp.float32)


def _lora_delta(x: jax.Array, lora: dict, module: str, scaling: float) -> jax.Array | None:
    """x [N, in] -> [N, out] delta of one HF module in this layer, or None when the adapter does not target it."""
    if module not in lora:
        return None
    a, b = lora[module]["A"], lora[module]["B"]  # [R, in], [out, R]
    delta = jnp.dot(jnp.dot(x.astype(a.dtype), a.T), b.T) * scaling
    return delta.astype(x.dtype)


def _plus(y: jax.Array, delta: jax.Array | None) -> jax.Array:
    return y if delta is None else y + delta


def _packed(linear, x: jax.Array, modules: tuple[str, ...], lora: dict, scaling: float, dot: Dot) -> list[jax.Array]:
    """A packed linear (qkv_proj, gate_up_proj): base GEMM split into its parts, each with its module's delta."""
    parts = split_packed(_base(linear, x, dot), linear.part_sizes, linear.tp_size)
    return [_plus(part, _lora_delta(x, lora, m, scaling)) for part, m in zip(parts, modules)]


def _attention(
    q: jax.Array, k: jax.Array, v: jax.Array, scale: float, window: int | jax.Array | None = None
) -> jax.Array:
    """Causal attention. q [B, S, H, D], k/v [B, S, K, D] (K kv heads, each serving H/K query heads) -> [B, S, H*D].
    window: the keys a query attends to, its own included (an int for every layer alike, or this layer's [] i32
    where layers differ); None: all up to its own. On GPU in 16-bit, cuDNN's fused flash attention (forward and
    backward, no [S, S] scores in memory) unless the window is traced; else XLA."""
    batch, seq_len, num_heads, head_dim = q.shape
    if _use_cudnn_attention(q) and not isinstance(window, jax.Array):
        local = None if window is None else (window - 1, 0)  # (keys before the query, keys after it)
        out = jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn", local_window_size=local
        )
        return out.reshape(batch, seq_len, num_heads * head_dim)
    groups = num_heads // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bshd,bthd->bhst", q, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.tril(jnp.ones((seq_len, seq_len), bool))
    if window is not None:
        position = jnp.arange(seq_len)
        causal &= position[:, None] - position[None, :] < window
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(v.dtype)
    out = jnp.einsum("bhst,bthd->bshd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(batch, seq_len, num_heads * head_dim)


def _use_cudnn_attention(q: jax.Array) -> bool:
    return jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] in (64, 128)


def _layer(
    layer,
    hidden: jax.Array,
    rotary: tuple[jax.Array, jax.Array],
    lora: dict,
    scaling: float,
    batch: int,
    dot: Dot,
    window: int | jax.Array | None = None,
) -> jax.Array:
    """One decoder layer. hidden [N, E] with N = B * S (row-major) -> [N, E]; rotary: the (cos, sin) tables of the
    N positions (layers/rotary.py rotary_tables, once per forward); window: its sliding window (`_attention`)."""
    num_tokens = hidden.shape[0]
    x = layer.input_layernorm(hidden)
    q, k, v = _packed(layer.qkv_proj, x, ("q_proj", "k_proj", "v_proj"), lora, scaling, dot)
    q = q.reshape(num_tokens, layer.num_heads, layer.head_dim)
    k = k.reshape(num_tokens, layer.num_kv_heads, layer.head_dim)
    v = v.reshape(num_tokens, layer.num_kv_heads, layer.head_dim)
    if layer.q_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    q, k = rotate(q, *rotary), rotate(k, *rotary)
    split = lambda t: t.reshape(batch, num_tokens // batch, *t.shape[1:])  # noqa: E731
    attn = _attention(split(q), split(k), split(v), layer.head_dim**-0.5, window).reshape(num_tokens, -1)
    hidden = hidden + _plus(_base(layer.o_proj, attn, dot), _lora_delta(attn, lora, "o_proj", scaling))
    x = layer.post_attention_layernorm(hidden)
    gate, up = _packed(layer.gate_up_proj, x, ("gate_proj", "up_proj"), lora, scaling, dot)
    act = jax.nn.silu(gate) * up
    return hidden + _plus(_base(layer.down_proj, act, dot), _lora_delta(act, lora, "down_proj", scaling))


def forward_logits(
    graphdef: nnx.GraphDef, base_state: nnx.State, lora: LoRAParams, input_ids: jax.Array, frozen_base: bool = True
) -> jax.Array:
    """input_ids [B, S] i32 -> logits [B, S, V] f32 of the base model with the adapter `lora` applied. frozen_base:
    the base weights get no gradient (LoRA training, through frozen_dot); False for full-parameter training."""
    dot = frozen_dot if frozen_base else trainable_dot
    model = nnx.merge(graphdef, base_state)
    batch, seq_len = input_ids.shape
    hidden = model.embed_tokens(input_ids.reshape(-1))
    rotary = rotary_tables(jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), batch), model.inv_freq, model.rotary_scale)
    layer_def, layer_state = nnx.split(model.layers)
    windows = model.config.sliding_windows
    uniform = windows[0] if windows and len(set(windows)) == 1 else None  # a static window: cuDNN takes it
    per_layer = layer_windows(windows) if windows and uniform is None else None  # traced, one a layer

    def body(h, xs):
        state, layer_lora, window = xs
        layer = nnx.merge(layer_def, state)
        return _layer(
            layer, h, rotary, layer_lora, lora.scaling, batch, dot, uniform if window is None else window
        ), None

    hidden, _ = jax.lax.scan(body, hidden, (layer_state, lora.weights, per_layer))
    return _logits(model, model.norm(hidden), dot).reshape(batch, seq_len, -1)


def token_logprobs(
    graphdef: nnx.GraphDef, base_state: nnx.State, lora: LoRAParams, input_ids: jax.Array, frozen_base: bool = True
) -> jax.Array:
    """input_ids [B, S] -> [B, S-1] f32: log p(input_ids[:, t+1] | input_ids[:, :t+1]) (frozen_base: as forward_logits)."""
    logits = forward_logits(graphdef, base_state, lora, input_ids, frozen_base)[:, :-1]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logprobs, input_ids[:, 1:, None], axis=-1)[..., 0]
