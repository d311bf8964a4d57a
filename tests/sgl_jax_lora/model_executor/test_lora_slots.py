"""A LoRA slot write from arrays staged on the devices (model_executor/lora_slots.py, ModelRunner.stage_lora_slot_values)
leaves the buffers exactly as the write from host arrays does, with each buffer's sharding kept, and runs the same
compiled program: staging on a prefetch thread never compiles on the engine loop. tp 1 and tp 4 on fake CPU devices.
A 16-bit adapter's slot arrays stay 16-bit on the host and are cast by the write on the device, to the values the
host cast gives, by programs the warmup's zero writes compiled."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from sgl_jax_lora.lora.memory_pool import slot_dtype
from sgl_jax_lora.managers.engine_core import EngineCore
from sgl_jax_lora.model_executor import lora_slots
from sgl_jax_lora.model_executor.compile_counter import CompileCounter
from sgl_jax_lora.server_args import ServerArgs
from tests.support.model_fixtures import make_hf_model_dir
from tests.support.peft_fixtures import write_peft_adapter


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("slots")
    # 8 heads of 6 and an intermediate size of 96 split over 4 devices
    base = make_hf_model_dir(root / "base", "llama", seed=5, num_attention_heads=8, head_dim=6, intermediate_size=96)
    adapter = write_peft_adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules="all-linear")
    return base, adapter


def buffers(runner) -> list[np.ndarray]:
    return [np.asarray(var.get_value()) for _, var in nnx.to_flat_state(runner.lora_state)]


def make_core(base, adapters: dict, tp: int = 1, dtype: str = "float32") -> EngineCore:
    args = ServerArgs(
        model_path=str(base),
        dtype=dtype,
        tp_size=tp,
        context_length=64,
        max_running_requests=4,
        chunked_prefill_size=32,
        max_prefill_seqs=2,
        page_size=4,
        max_total_tokens=64,
        skip_precompile=True,
        lora_paths={name: str(path) for name, path in adapters.items()},
        max_loras_per_batch=3,
    )
    return EngineCore(args, str(base))


@pytest.mark.parametrize("tp", [1, 4])
def test_a_staged_slot_write_equals_the_host_write_and_compiles_nothing(model_and_adapter, tp):
    base, adapter_dir = model_and_adapter
    core = make_core(base, {"a": adapter_dir}, tp)
    runner, manager = core.runner, core.lora
    _, host_values = manager._host_slot_arrays(next(iter(manager.refs.values())))
    assert any(np.abs(v).max() > 0 for v in host_values)
    runner.write_lora_slot(1, host_values)  # the write program compiles here, as at warmup
    shardings = [var.get_value().sharding for _, var in nnx.to_flat_state(runner.lora_state)]
    counter = CompileCounter()
    staged: list = []
    thread = threading.Thread(target=lambda: staged.extend(runner.stage_lora_slot_values(host_values)))
    thread.start()  # as LoRAManager's prefetch threads stage
    thread.join()
    assert [a.sharding.is_fully_addressable for a in staged] == [True] * len(staged)
    runner.write_lora_slot(2, staged)
    after = buffers(runner)
    assert counter.count == 0, "the write of staged arrays compiled a program of its own"
    for buffer, value in zip(after, host_values):
        np.testing.assert_array_equal(buffer[:, 1], value)
        np.testing.assert_array_equal(buffer[:, 2], value)
    assert [var.get_value().sharding for _, var in nnx.to_flat_state(runner.lora_state)] == shardings


@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_a_16_bit_adapter_is_cast_by_the_write_on_the_device(model_and_adapter, tmp_path, model_dtype, half):
    base, adapter_dir = model_and_adapter
    half_dir = tmp_path / "half"
    half_dir.mkdir()
    (half_dir / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    tensors = {k: v.to(half) for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}
    save_file(tensors, str(half_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    core = make_core(base, {"half": half_dir}, dtype=model_dtype)
    runner, manager = core.runner, core.lora
    for zeros in lora_slots.zero_updates(runner.lora_buffer_shapes(), runner.dtype):  # what the warmup writes
        runner.write_lora_slot(0, runner.lora_slot_values(zeros))
    counter = CompileCounter()
    adapter, values = manager._host_slot_arrays(next(iter(manager.refs.values())))
    assert slot_dtype(adapter, runner.dtype) == jnp.dtype(str(half).split(".")[-1])
    assert {v.dtype for v in values} == {slot_dtype(adapter, runner.dtype)}  # no cast on the host
    runner.write_lora_slot(1, runner.stage_lora_slot_values(values))
    runner.write_lora_slot(2, values)
    assert counter.count == 0, "a 16-bit slot write compiled after the warmup's writes"
    host_cast = runner.lora_slot_values(manager.pool.slot_update(adapter, runner.dtype))
    for buffer, expected in zip(buffers(runner), host_cast):
        assert buffer.dtype == runner.dtype
        np.testing.assert_array_equal(buffer[:, 1], expected)
        np.testing.assert_array_equal(buffer[:, 2], expected)
