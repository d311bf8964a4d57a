"""LoRAMemoryPool (lora/memory_pool.py), the device tier on the host alone: slot 0 is never handed out, victims are
neither pinned nor busy and follow the eviction policy, releasing clears a slot's scale and rank, and
`slot_update` lays an adapter out as the LoRA buffers expect (A parts stacked along the rank at max_rank strides,
B in its first `rank` columns, kv heads replicated when tp exceeds them, absent modules zero)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.configs.model_config import ModelConfig, RopeConfig
from sgl_jax_lora.lora import memory_pool
from sgl_jax_lora.lora.adapter import LoRAAdapter
from sgl_jax_lora.lora.memory_pool import LoRAMemoryPool

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MAX_RANK, SLOTS = 2, 8, 2, 1, 4, 4, 3


def tiny_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=16,
        hidden_size=HIDDEN,
        intermediate_size=16,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0, rope_type="default"),
        max_position_embeddings=64,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
        eos_token_ids=(0,),
    )


def buffer_shapes(tp_size: int) -> dict[tuple[str, ...], tuple[int, ...]]:
    kv_rows = max(1, KV_HEADS // tp_size) * tp_size * HEAD_DIM  # kv heads replicated up to one per shard
    return {
        ("layers", "qkv_proj", "lora_a"): (LAYERS, SLOTS, 3 * MAX_RANK, HIDDEN),
        ("layers", "qkv_proj", "lora_b_q"): (LAYERS, SLOTS, HEADS * HEAD_DIM, MAX_RANK),
        ("layers", "qkv_proj", "lora_b_k"): (LAYERS, SLOTS, kv_rows, MAX_RANK),
        ("layers", "qkv_proj", "lora_b_v"): (LAYERS, SLOTS, kv_rows, MAX_RANK),
        ("layers", "o_proj", "lora_b"): (LAYERS, SLOTS, HIDDEN, MAX_RANK),
        ("layers", "o_proj", "lora_a"): (LAYERS, SLOTS, MAX_RANK, HEADS * HEAD_DIM),
    }


def make_pool(tp_size: int = 1, policy: str = "lru") -> LoRAMemoryPool:
    return LoRAMemoryPool(tiny_config(), tp_size, SLOTS, MAX_RANK, buffer_shapes(tp_size), policy)


def adapter(name: str, rank: int = 2, seed: int = 0, modules=("q_proj", "k_proj")) -> LoRAAdapter:
    rng = np.random.default_rng(seed)
    out = {"q_proj": HEADS * HEAD_DIM, "k_proj": KV_HEADS * HEAD_DIM, "v_proj": KV_HEADS * HEAD_DIM, "o_proj": HIDDEN}
    weights = {
        (layer, m): (
            rng.standard_normal((rank, HIDDEN)).astype(np.float32),
            rng.standard_normal((out[m], rank)).astype(np.float32),
        )
        for layer in range(LAYERS)
        for m in modules
    }
    return LoRAAdapter(
        name=name,
        path=f"/adapters/{name}",
        weights=weights,
        scaling=0.5,
        rank=rank,
        target_modules=frozenset(modules),
        num_layers=LAYERS,
    )


def test_slots_fill_from_one_and_evict_the_least_recently_used():
    pool = make_pool()
    assert pool.free_slot() == 1
    pool.assign(1, "a", 2, 0.5)
    pool.assign(pool.free_slot(), "b", 2, 0.5)
    assert pool.free_slot() is None and pool.slot_of == {"a": 1, "b": 2}
    pool.policy.mark_used("a")  # b is now the least recently used
    assert pool.victim(busy=set()) == 2
    assert pool.victim(busy={"b"}) == 1
    pool.pinned.add("a")
    assert pool.victim(busy={"b"}) is None
    pool.assign(2, "c", 2, 0.5)  # overwrites b
    assert pool.num_evictions == 1 and "b" not in pool.slot_of and pool.slot_owner == [None, "a", "c"]


def test_release_clears_the_slot_and_its_pin():
    pool = make_pool()
    pool.assign(1, "a", 3, 0.5)
    pool.pinned.add("a")
    assert (pool.slot_scale[1], pool.slot_rank[1]) == (0.5, 3)
    pool.release("a")
    assert pool.slot_owner[1] is None and "a" not in pool.pinned
    assert (pool.slot_scale[1], pool.slot_rank[1]) == (0.0, 0)
    pool.release("never-assigned")  # a no-op


def test_slot_update_lays_out_a_and_b():
    pool, lora = make_pool(), adapter("a", rank=2)
    update = pool.slot_update(lora)
    a = update[("layers", "qkv_proj", "lora_a")]
    assert a.shape == (LAYERS, 3 * MAX_RANK, HIDDEN)
    for layer in range(LAYERS):
        np.testing.assert_array_equal(a[layer, 0:2], lora.weights[(layer, "q_proj")][0])  # q at part 0
        np.testing.assert_array_equal(a[layer, MAX_RANK : MAX_RANK + 2], lora.weights[(layer, "k_proj")][0])
        assert not a[layer, 2:MAX_RANK].any() and not a[layer, 2 * MAX_RANK :].any()  # above rank; v absent
        b_q = update[("layers", "qkv_proj", "lora_b_q")][layer]
        np.testing.assert_array_equal(b_q[:, :2], lora.weights[(layer, "q_proj")][1])
        assert not b_q[:, 2:].any()
    assert not update[("layers", "qkv_proj", "lora_b_v")].any() and not update[("layers", "o_proj", "lora_b")].any()
    assert all(not z.any() and z.shape == update[path].shape for path, z in pool.zero_update().items())


def test_slot_update_in_the_model_dtype_rounds_once():
    """Laid out in bf16 directly, a slot's arrays are bit for bit the float32 layout rounded to bf16 (the write's
    cast before), and the zeros come in the same dtype."""
    pool, lora = make_pool(), adapter("a", rank=3)
    direct = pool.slot_update(lora, jnp.bfloat16)
    for path, f32 in pool.slot_update(lora).items():
        assert direct[path].dtype == jnp.bfloat16
        np.testing.assert_array_equal(direct[path].view(np.uint16), f32.astype(jnp.bfloat16).view(np.uint16))
    assert all(z.dtype == jnp.bfloat16 for z in pool.zero_update(jnp.bfloat16).values())


@pytest.mark.parametrize(
    ("rank", "drop"),
    [(MAX_RANK, ()), (2, ()), (MAX_RANK, ((1, "k_proj"),)), (MAX_RANK, tuple((i, "v_proj") for i in range(LAYERS)))],
)
def test_slot_update_zeroes_what_the_adapter_leaves_unwritten_in_recycled_memory(monkeypatch, rank, drop):
    """The slot arrays are allocated unfilled: memory that held other values (NaN here) is zero wherever the adapter
    writes nothing (rows above its rank, a layer or module it lacks), and a full-rank adapter on every module and
    layer leaves nothing of it."""
    lora = adapter("a", rank=rank, modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    for key in drop:
        del lora.weights[key]
    clean = {path: value.copy() for path, value in make_pool().slot_update(lora).items()}
    monkeypatch.setattr(np, "empty", lambda shape, dtype=float: np.full(shape, np.nan, dtype))
    for path, value in make_pool().slot_update(lora).items():
        np.testing.assert_array_equal(value, clean[path])


@pytest.mark.parametrize("tp_size", [1, 2])
def test_layers_read_from_one_file_are_copied_in_one_call_a_module(monkeypatch, tp_size):
    """An adapter read from one file holds its tensors as views of the file's data
    (adapter_files.read_checked_safetensors); the layout copies each module part's layers at once through a strided
    view, in the file's order of layers (safetensors sorts names: layer 10 before layer 2), to the same slot arrays as
    one copy a layer. Replicated kv heads (new arrays) take the per-layer path."""
    lora = adapter("a", rank=3, modules=("q_proj", "k_proj"))
    order = [(layer, m) for layer in reversed(range(LAYERS)) for m in ("k_proj", "q_proj")]
    flat = np.concatenate([lora.weights[key][i].ravel() for key in order for i in (0, 1)])
    views, offset = {}, 0
    for key in order:
        a, b = lora.weights[key]
        views[key] = tuple(flat[o : o + x.size].reshape(x.shape) for o, x in ((offset, a), (offset + a.size, b)))
        offset += a.size + b.size
    from_file = dataclasses.replace(lora, weights=views)
    strided = []
    real = memory_pool._evenly_spaced
    monkeypatch.setattr(
        memory_pool, "_evenly_spaced", lambda arrays, starts: strided.append(real(arrays, starts)) or strided[-1]
    )
    pool = make_pool(tp_size)
    laid_out = pool.slot_update(from_file)
    assert sum(view is not None for view in strided) == (3 if tp_size > 1 else 4)  # A q, A k, B q (and B k at tp 1)
    for path, expected in pool.slot_update(lora).items():  # separate arrays: one copy a layer
        np.testing.assert_array_equal(laid_out[path], expected)


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    pool, lora = make_pool(tp_size=2), adapter("a", rank=2)
    b_k = pool.slot_update(lora)[("layers", "qkv_proj", "lora_b_k")]
    hf = lora.weights[(0, "k_proj")][1]  # [K*D, r], one kv head
    assert b_k.shape == (LAYERS, 2 * HEAD_DIM, MAX_RANK)
    np.testing.assert_array_equal(b_k[0, :HEAD_DIM, :2], hf)
    np.testing.assert_array_equal(b_k[0, HEAD_DIM:, :2], hf)


@pytest.mark.parametrize("policy, victim", [("lru", "b"), ("fifo", "a")])
def test_the_configured_policy_picks_the_victim(policy, victim):
    pool = make_pool(policy=policy)
    pool.assign(1, "a", 2, 0.5)
    pool.assign(2, "b", 2, 0.5)
    pool.policy.mark_used("a")  # used again after b arrived
    assert pool.slot_owner[pool.victim(busy=set())] == victim
