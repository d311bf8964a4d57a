"""sgl_jax_lora/models/llama.py (the one Llama-family class behind every architecture): parity with HF transformers
(torch, fp32) for each architecture, tensor parallel vs tp=1, and the GPU attention backend's layer path (the rotary
+ K/V write kernel masking the padding rows of an unzeroed q|k|v) against the native one.

Runs one extend step of the model in-process (no engine process) on fake CPU devices. Also checks the two
tables the model declares: every parameter's logical axes (and the shardings they give) and the HF weight
names every checkpoint tensor is read through.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import sgl_jax_lora.layers.base_gemm as base_gemm_module
import sgl_jax_lora.models.llama as llama_module
from pallas_kernels.sgmv.gemm_gpu import gemm_gpu
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.attention import AttentionBackend
from sgl_jax_lora.layers.sharding import declared_axes, make_mesh, state_shardings
from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
from sgl_jax_lora.lora.lora_linear import LoRAModelSpec
from sgl_jax_lora.mem_cache.kv_cache import allocate_kv_cache
from sgl_jax_lora.models.forward_batch import ForwardBatch
from sgl_jax_lora.models.registry import model_class_for
from sgl_jax_lora.models.weight_loader import SafetensorsReader, load_model_state
from tests.support.kernel_sized_engine import make_kernel_sized_model
from tests.support.model_fixtures import ARCH_CONFIGS, load_hf_model, make_hf_model_dir
from tests.support.model_forward import PAGE, model_logits


def our_logits(model_dir, ids: np.ndarray, tp_size: int = 1) -> np.ndarray:
    return model_logits(model_dir, ids, jnp.float32, tp_size)


def hf_logits(model_dir, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return load_hf_model(model_dir)(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_logprobs_match_hf(tmp_path, arch):
    model_dir = make_hf_model_dir(tmp_path / arch, arch)
    ids = np.random.default_rng(1).integers(2, 491, size=37)
    ours, ref = log_softmax(our_logits(model_dir, ids)), log_softmax(hf_logits(model_dir, ids))
    assert np.abs(ours - ref).max() < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


# sliding windows shorter than the prompt: Mistral's on every layer, Qwen2's from layer max_window_layers on
WINDOWED = {
    "mistral": dict(sliding_window=7),
    "qwen2": dict(sliding_window=5, use_sliding_window=True, max_window_layers=1),
}


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("backend", ["native", "pallas_interpret"])
@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_sliding_window_logprobs_match_hf(tmp_path, arch, backend, tp_size):
    model_dir = make_hf_model_dir(tmp_path / arch, arch, **WINDOWED[arch])
    assert any(ModelConfig.from_model_path(str(model_dir)).sliding_windows)
    ids = np.random.default_rng(2).integers(2, 491, size=37)
    ours = log_softmax(model_logits(model_dir, ids, jnp.float32, tp_size, attention_backend=backend))
    ref = log_softmax(hf_logits(model_dir, ids))
    assert np.abs(ours - ref).max() < 1e-4
    full = log_softmax(hf_logits(make_hf_model_dir(tmp_path / "full", arch, sliding_window=None), ids))
    assert np.abs(full - ref)[10:].max() > 1e-2  # the window changes the later tokens: the check above means something


def assert_gpu_backend_matches_hf(model_dir, seed: int) -> None:
    """The model's logprobs over 45 random tokens through the GPU attention backend are HF's (float32 products)."""
    ids = np.random.default_rng(seed).integers(2, 491, size=45)
    with jax.default_matmul_precision("highest"):
        ours = log_softmax(model_logits(model_dir, ids, jnp.float32, attention_backend="pallas_gpu"))
    ref = log_softmax(hf_logits(model_dir, ids))
    assert np.abs(ours - ref).max() < 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads,kv_heads,hidden", [(4, 2, 128), (14, 2, 224)])
def test_gpu_attention_backend_matches_hf(tmp_path, heads, kv_heads, hidden):
    # the GPU path of a layer: q and k rotated and K/V written by one kernel, then the Triton attention kernels; at
    # GQA 2 and at GQA 7 (Qwen2.5-7B's: not a power of two)
    model_dir = make_hf_model_dir(
        tmp_path / "m",
        "llama",
        head_dim=32,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    assert_gpu_backend_matches_hf(model_dir, seed=4)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_gpu_attention_backend_matches_hf_for_every_architecture(tmp_path, arch):
    # each architecture's rope (Llama-3's, YaRN's with its attention factor) and q/k norms (Qwen3's) through the fused
    # rotary + K/V write kernel and the Triton attention kernels, at a head size those kernels take
    shape = dict(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    assert_gpu_backend_matches_hf(make_hf_model_dir(tmp_path / arch, arch, **shape), seed=6)


def prefill_then_decode_batches(lengths: list[int], new_ids: np.ndarray, bucket: int) -> tuple:
    """A prefill forward of sequences of `lengths` (each on pages of its own) and the decode step after it: one new
    token a sequence (new_ids), padded to `bucket` tokens and sequences."""
    pages_per_seq = -(-(max(lengths) + 1) // PAGE)
    table = 1 + np.arange(len(lengths) * pages_per_seq, dtype=np.int32).reshape(len(lengths), pages_per_seq)
    slot = lambda seq, pos: table[seq, pos // PAGE] * PAGE + pos % PAGE  # noqa: E731
    seqs = np.repeat(np.arange(len(lengths)), lengths)
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    prefill = dict(positions=positions, cache_loc=slot(seqs, positions).astype(np.int32), seq_lens=np.int32(lengths))
    prefill.update(page_table=table, cu_q_lens=cu, last_token_index=cu[1:] - 1)
    pad, last = bucket - len(lengths), np.int32(lengths)
    decode = dict(
        input_ids=np.pad(np.int32(new_ids), (0, pad)),
        positions=np.pad(last, (0, pad)),
        cache_loc=np.pad(slot(np.arange(len(lengths)), last).astype(np.int32), (0, pad)),
        seq_lens=np.pad(last + 1, (0, pad)),
        page_table=np.pad(table, ((0, pad), (0, 0))),
        cu_q_lens=np.pad(np.arange(len(lengths) + 1, dtype=np.int32), (0, pad), mode="edge"),
        last_token_index=np.pad(np.arange(len(lengths), dtype=np.int32), (0, pad)),
    )
    return prefill, decode


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_gpu_decode_step_program_matches_the_any_mix_program_and_hf(tmp_path):
    # a decode step of three sequences of different lengths, padded to 8 tokens: in its own program (the decode
    # kernel alone, one row a token, longest first) its logits are the program of any mix's and HF's last-token ones
    model_dir = make_hf_model_dir(tmp_path / "m", "llama", head_dim=32, hidden_size=128, num_attention_heads=4)
    lengths, rng = [13, 30, 7], np.random.default_rng(9)
    prompts = [rng.integers(2, 491, n) for n in lengths]
    new_ids = rng.integers(2, 491, len(lengths))
    prefill, decode = prefill_then_decode_batches(lengths, new_ids, bucket=8)
    cfg = ModelConfig.from_model_path(str(model_dir))
    mesh = make_mesh(1)
    graphdef, state = load_model_state(cfg, 1, PAGE, jnp.float32, mesh, None, attention_backend="pallas_gpu")
    kv = allocate_kv_cache(cfg, 1 + len(lengths) * prefill["page_table"].shape[1], PAGE, 1, jnp.float32, mesh)

    @jax.jit
    def run(state, kv, batch):
        model = nnx.merge(graphdef, state)
        hidden, kv = model(kv, batch)
        return model.logits(hidden[batch.last_token_index]), kv

    with jax.default_matmul_precision("highest"):
        _, kv = run(state, kv, ForwardBatch(input_ids=np.concatenate(prompts).astype(np.int32), lora=None, **prefill))
        mixed, _ = run(state, kv, ForwardBatch(lora=None, **decode))
        alone, _ = run(state, kv, ForwardBatch(lora=None, decode_only=True, **decode))
    mixed, alone = log_softmax(np.asarray(mixed)[:3]), log_softmax(np.asarray(alone)[:3])
    assert np.abs(alone - mixed).max() < 1e-5
    for i, prompt in enumerate(prompts):
        ref = log_softmax(hf_logits(model_dir, np.append(prompt, new_ids[i]))[-1:])[0]
        assert np.abs(alone[i] - ref).max() < 1e-3 and alone[i].argmax() == ref.argmax()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_gpu_attention_backend_with_sliding_windows_matches_hf(tmp_path):
    # Qwen2 with its second layer windowed: the Triton kernels take each layer's window from the rolled loop
    overrides = dict(sliding_window=9, use_sliding_window=True, max_window_layers=1)
    shape = dict(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model_dir = make_hf_model_dir(tmp_path / "m", "qwen2", **overrides, **shape)
    assert_gpu_backend_matches_hf(model_dir, seed=5)


def test_fused_rope_kv_write_takes_the_unzeroed_qkv_and_gives_the_native_layers_logits(tmp_path, monkeypatch):
    """A padded bucket (200 tokens in 256) through a model whose linears run the base GEMM kernel (its reference on
    CPU), on the GPU attention backend's layer path: q|k|v comes out with its padding rows unzeroed
    (zero_padding=False, only for q|k|v) and goes to the rotary + K/V write kernel (interpret mode) with the step's
    200 real rows, whose q comes out zero in the padding rows; the real tokens' logits are those of the native path
    (XLA's rotary and write_kv over the zeroed q|k|v). The attention itself runs natively (its Triton kernels need a
    GPU)."""
    model_dir = make_kernel_sized_model(tmp_path / "m")  # head_dim 128: the kernel takes it
    real_rotate, real_attention, real_gemm = llama_module.rotate_and_write_kv, llama_module.paged_attention, gemm_gpu
    seen = collections.defaultdict(list)

    def interpreted(qkv, *args, num_rows):
        record = lambda name, value: seen[name].append(float(value))  # noqa: E731
        jax.debug.callback(functools.partial(record, "rows"), num_rows[0])
        jax.debug.callback(functools.partial(record, "qkv padding"), jnp.abs(qkv[200:]).max())
        q, k_cache, v_cache = real_rotate(qkv, *args, True, num_rows)  # interpret=True
        jax.debug.callback(functools.partial(record, "q padding"), jnp.abs(q[200:]).max())
        return q, k_cache, v_cache

    def native_attention(*args, plan, sliding_window):  # the backend is the last argument; native takes no plan
        return real_attention(*args[:-1], AttentionBackend("native"), sliding_window=sliding_window)

    def recorded_gemm(*args, zero_padding=True, **kwargs):
        seen["zero_padding"].append(zero_padding)
        return real_gemm(*args, zero_padding=zero_padding, **kwargs)

    monkeypatch.setattr(llama_module, "rotate_and_write_kv", interpreted)
    monkeypatch.setattr(llama_module, "paged_attention", native_attention)
    monkeypatch.setattr(base_gemm_module, "gemm_gpu", recorded_gemm)
    ids = np.random.default_rng(8).integers(2, 491, 200)
    forward = functools.partial(model_logits, model_dir, ids, jnp.bfloat16, bucket=256, base_gemm_min_tokens=256)
    expected = forward(attention_backend="native")
    assert seen["zero_padding"] == [True] * 4 and "rows" not in seen  # q|k|v, o, gate|up, down: all zeroed
    seen.clear()
    ours = forward(attention_backend="pallas_gpu")
    assert seen["zero_padding"] == [False, True, True, True]  # q|k|v only (traced once in the layer scan)
    assert set(seen["rows"]) == {200} and len(seen["rows"]) == 2  # both layers
    assert min(seen["qkv padding"]) > 0  # the padding rows reach the kernel as the GEMM left them
    assert max(seen["q padding"]) == 0
    # equal on CPU (measured); a bf16 step of the two rotaries' rounding allowed elsewhere
    assert np.abs(ours - expected).max() <= 1e-2 * np.abs(expected).max()


@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_tensor_parallel_equals_tp1(tmp_path, tp_size):
    # 8 query heads, 2 kv heads: tp 4 and 8 replicate kv heads across shards.
    model_dir = make_hf_model_dir(tmp_path / "m", "qwen2", num_attention_heads=8, head_dim=6, intermediate_size=96)
    ids = np.random.default_rng(2).integers(2, 491, size=21)
    base = our_logits(model_dir, ids, tp_size=1)
    sharded = our_logits(model_dir, ids, tp_size=tp_size)
    assert np.abs(base - sharded).max() < 1e-5


def test_tp_that_does_not_divide_heads_is_refused(tmp_path):
    cfg = ModelConfig.from_model_path(str(make_hf_model_dir(tmp_path / "m", "llama")))
    with pytest.raises(ValueError, match="--tp-size 4 does not divide num_attention_heads=6"):
        cfg.check_tensor_parallel(4)


def abstract_state(cfg: ModelConfig, tp_size: int, lora: LoRAModelSpec | None) -> nnx.State:
    model = nnx.eval_shape(lambda: model_class_for(cfg)(cfg, tp_size, PAGE, jnp.float32, lora))
    return nnx.split(model)[1]


def flat_paths(state: nnx.State) -> list[tuple[tuple[str, ...], nnx.Variable]]:
    return [(tuple(str(p) for p in path), variable) for path, variable in nnx.to_flat_state(state)]


def test_every_parameter_declares_the_logical_axes_of_its_sharding(tmp_path):
    # Qwen3 with every LoRA target: norms of heads, untied lm_head, LoRA buffers of every linear
    cfg = ModelConfig.from_model_path(str(make_hf_model_dir(tmp_path / "m", "qwen3")))
    lora = LoRAModelSpec(
        num_slots=3,
        max_rank=4,
        backend=BgmvBackend(None),
        target_modules=frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}),
    )
    state = abstract_state(cfg, 2, lora)
    for path, variable in flat_paths(state):
        axes = declared_axes(path, variable)
        assert len(axes) == variable.get_value().ndim and (axes[0] == "layers") == (path[0] == "layers"), path
    t = "tensor"
    expected = {  # tp 2; a vocab of 491 does not split over 2, so it stays replicated
        "embed_tokens.embedding": (None, None),
        "lm_head.kernel": (None, None),
        "norm.scale": (None,),
        "layers.input_layernorm.scale": (None, None),
        "layers.post_attention_layernorm.scale": (None, None),
        "layers.q_norm.scale": (None, None),
        "layers.k_norm.scale": (None, None),
        "layers.qkv_proj.kernel": (None, None, t),
        "layers.qkv_proj.lora_a": (None, None, None, None),
        "layers.qkv_proj.lora_b_q": (None, None, t, None),
        "layers.qkv_proj.lora_b_k": (None, None, t, None),
        "layers.qkv_proj.lora_b_v": (None, None, t, None),
        "layers.o_proj.kernel": (None, t, None),
        "layers.o_proj.lora_a": (None, None, None, t),
        "layers.o_proj.lora_b": (None, None, None, None),
        "layers.gate_up_proj.kernel": (None, None, t),
        "layers.gate_up_proj.lora_a": (None, None, None, None),
        "layers.gate_up_proj.lora_b_gate": (None, None, t, None),
        "layers.gate_up_proj.lora_b_up": (None, None, t, None),
        "layers.down_proj.kernel": (None, t, None),
        "layers.down_proj.lora_a": (None, None, None, t),
        "layers.down_proj.lora_b": (None, None, None, None),
    }
    shardings = state_shardings(make_mesh(2), state)
    assert {".".join(path): tuple(s.spec) for path, s in shardings.items()} == expected


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_hf_weight_table_maps_every_checkpoint_tensor_to_one_parameter(tmp_path, arch):
    model_dir = make_hf_model_dir(tmp_path / arch, arch)
    cfg = ModelConfig.from_model_path(str(model_dir))
    hf_weights = model_class_for(cfg).hf_weights
    used = collections.Counter()
    for path, _ in flat_paths(abstract_state(cfg, 1, None)):
        for names in hf_weights[".".join(path)].tensor_names(cfg.num_layers):
            used.update(names)
    checkpoint = set(SafetensorsReader(str(model_dir)).file_of)
    assert set(used) == checkpoint, (sorted(checkpoint - set(used)), sorted(set(used) - checkpoint))
    assert max(used.values()) == 1, [name for name, count in used.items() if count > 1]
