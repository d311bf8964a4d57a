"""q|k|v's LoRA delta handed to the rotary + K/V write kernel (`LoRALinear.with_delta_apart`, the Pallas GPU
backend's `qkv_delta`) against the engine's add before it: one engine over the kernel-sized Llama, two adapters and
base, on the GPU attention backend's layer path on CPU (the rotary + K/V write kernel in interpret mode; the attention
itself native, since its Triton kernels need a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import sgl_jax_lora.models.llama as llama_module
from sgl_jax_lora.layers.attention import AttentionBackend
from tests.support.kernel_sized_engine import (
    build_gpu_backends_with,
    make_kernel_sized_model_and_adapters,
    serve_logprobs,
)


@pytest.mark.slow
def test_engine_with_qkv_delta_in_the_rotary_kernel_equals_the_add_before_it(tmp_path, monkeypatch):
    """With the delta apart, the programs of the steps with adapter tokens (the 256-token prefill and the 128-token
    decode steps) hand the kernel a delta (a program without adapter tokens has none), and without it none does; the
    prompt and output logprobs are bit for bit those of q|k|v + delta added before the kernel (the kernel rounds the
    sum as XLA's add does; the delta moves them by up to 2.4, so a kernel that dropped it would fail)."""
    model_dir, adapters = make_kernel_sized_model_and_adapters(tmp_path)
    real_rotate, real_attention = llama_module.rotate_and_write_kv, llama_module.paged_attention
    deltas = []

    def interpreted(qkv, *args, num_rows, delta):
        deltas.append((qkv.shape[0], delta is not None))  # once per traced step program (one layer in the loop)
        return real_rotate(qkv, *args, True, num_rows, delta=delta)  # interpret=True

    def native_attention(*args, plan, sliding_window):  # the backend is the last argument; native takes no plan
        return real_attention(*args[:-1], AttentionBackend("native"), sliding_window=sliding_window)

    monkeypatch.setattr(llama_module, "fuses_rope_kv_write", lambda backend, head_dim: True)
    monkeypatch.setattr(llama_module, "rotate_and_write_kv", interpreted)
    monkeypatch.setattr(llama_module, "paged_attention", native_attention)

    def serve_with(qkv_delta: bool) -> list[np.ndarray]:
        build_gpu_backends_with(monkeypatch, qkv_delta=qkv_delta)
        deltas.clear()
        prompt, output = serve_logprobs(model_dir, adapters, 3)
        return [np.concatenate([p, o]) for p, o in zip(prompt, output)]

    expected = serve_with(False)
    assert deltas and not any(given for _, given in deltas)
    ours = serve_with(True)
    assert sorted(bucket for bucket, given in deltas if given) == [128, 256]  # the steps with adapter tokens
    for got, want in zip(ours, expected):
        assert len(got) == len(want)
        np.testing.assert_array_equal(got, want)
