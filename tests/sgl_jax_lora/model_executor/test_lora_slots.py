"""A LoRA slot write from arrays staged on the devices (model_executor/lora_slots.py, ModelRunner.stage_lora_slot_values)
leaves the buffers exactly as the write from host arrays does, with each buffer's sharding kept, and runs the same
compiled program: staging on a prefetch thread never compiles on the engine loop. tp 1 and tp 4 on fake CPU devices."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from flax import nnx

from sgl_jax_lora.managers.engine_core import EngineCore
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


@pytest.mark.parametrize("tp", [1, 4])
def test_a_staged_slot_write_equals_the_host_write_and_compiles_nothing(model_and_adapter, tp):
    base, adapter_dir = model_and_adapter
    args = ServerArgs(
        model_path=str(base),
        dtype="float32",
        tp_size=tp,
        context_length=64,
        max_running_requests=4,
        chunked_prefill_size=32,
        max_prefill_seqs=2,
        page_size=4,
        max_total_tokens=64,
        skip_precompile=True,
        lora_paths={"a": str(adapter_dir)},
        max_loras_per_batch=3,
    )
    core = EngineCore(args, str(base))
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
