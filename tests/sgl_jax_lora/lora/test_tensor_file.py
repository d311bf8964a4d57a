"""sgl_jax_lora/lora/tensor_file.py: TensorFile (arrays or an HTTP body written to shared-memory safetensors shards,
checked finite on the writer threads) and map_tensor_files (the shards mapped back as float32 arrays, malformed files
refused with the problem named).
"""

from __future__ import annotations

import glob
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save as save_file_bytes

from sgl_jax_lora.lora.tensor_file import TensorFile, map_tensor_files


def test_a_tensor_file_of_every_float_dtype_maps_in_its_dtype_and_float64_as_float32(tmp_path):
    import torch
    from safetensors.torch import save

    from sgl_jax_lora.lora.peft_config import LoRAAdapterError

    values = torch.tensor([[1.5, -2.25], [0.0, 3.0]])
    data = save(
        {f"t_{dtype}": values.to(dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
    )
    with TensorFile.from_bytes(data) as tensor_file:
        tensors = map_tensor_files("x", tensor_file.paths)
    assert len(tensors) == 4  # the mapping outlives the file's name
    expected = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float64": np.float32}
    for key, array in tensors.items():
        assert array.dtype == np.dtype(expected[key.removeprefix("t_torch.")])
        assert np.array_equal(array.astype(np.float32), values.numpy())
    assert not tensors["t_torch.float16"].flags.writeable  # 16-bit: a view of the shared mapping, not a copy
    with TensorFile.from_bytes(save({"ids": torch.zeros(2, dtype=torch.int32)})) as tensor_file:
        with pytest.raises(LoRAAdapterError, match="dtype I32"):
            map_tensor_files("x", tensor_file.paths)


def test_arrays_written_by_the_frontend_read_back_unchanged_in_their_dtype():
    rng = np.random.default_rng(0)
    arrays = {
        "a": rng.standard_normal((3, 5), dtype=np.float32),
        "b": rng.standard_normal(7).astype(np.float16),
        "c": rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16),
        "d": np.zeros((0, 4), np.float32),
    }
    with TensorFile.from_arrays("x", arrays) as tensor_file:
        tensors = map_tensor_files("x", tensor_file.paths)
    for key, array in arrays.items():
        assert tensors[key].dtype == array.dtype and np.array_equal(tensors[key].view(np.uint8), array.view(np.uint8))
        assert tensors[key].shape == array.shape
        assert not tensors[key].flags.writeable  # a view of the shared mapping, not a copy


def test_big_endian_and_torch_arrays_read_back_as_their_values():
    import torch

    values = np.array([[1.5, -2.25], [0.0, 3.0]], np.float32)
    arrays = {
        "big_f4": values.astype(">f4"),
        "big_f8": values.astype(">f8"),
        "big_f2": values.astype(">f2"),
        "torch_bf16": torch.tensor(values).to(torch.bfloat16),
        "torch_grad": torch.tensor(values, requires_grad=True),
    }
    with TensorFile.from_arrays("x", arrays) as tensor_file:
        tensors = map_tensor_files("x", tensor_file.paths)
    for key in arrays:
        assert np.array_equal(tensors[key], values), key


def test_large_arrays_are_written_as_shards_on_threads_and_read_back_whole(monkeypatch):
    import sgl_jax_lora.lora.tensor_file as tensor_file_module
    from sgl_jax_lora.lora.peft_config import LoRAAdapterError

    monkeypatch.setattr(tensor_file_module, "MIN_SHARD_BYTES", 64)
    rng = np.random.default_rng(1)
    arrays = {f"layer{i}.lora_A.weight": rng.standard_normal((4, 8 + i), dtype=np.float32) for i in range(11)}
    with TensorFile.from_arrays("x", arrays) as tensor_file:
        paths = list(tensor_file.paths)
        assert len(paths) == tensor_file_module.WRITE_THREADS  # 11 tensors of >= 128 bytes: every thread writes
        tensors = map_tensor_files("x", paths)
        shards = [map_tensor_files("x", [path]) for path in paths]
        with pytest.raises(LoRAAdapterError, match="given twice"):
            map_tensor_files("x", [paths[0], paths[0]])
    assert not any(os.path.exists(path) for path in paths)  # every shard removed
    assert sorted(k for shard in shards for k in shard) == sorted(arrays)  # each tensor in exactly one shard
    for key, array in arrays.items():
        assert np.array_equal(tensors[key], array)


def _tensor_files_in_shm() -> set[str]:
    return set(glob.glob("/dev/shm/sgl-jax-lora-tensors-*"))


def test_a_non_finite_array_is_refused_as_it_is_written_and_no_shard_stays(monkeypatch):
    import sgl_jax_lora.lora.tensor_file as tensor_file_module
    from sgl_jax_lora.lora.peft_config import LoRAAdapterError

    monkeypatch.setattr(tensor_file_module, "MIN_SHARD_BYTES", 64)
    rng = np.random.default_rng(2)
    arrays = {f"layer{i}.lora_B.weight": rng.standard_normal((8 + i, 4), dtype=np.float32) for i in range(11)}
    with TensorFile.from_arrays("x", arrays) as tensor_file:
        assert tensor_file.checked_finite and len(tensor_file.paths) == tensor_file_module.WRITE_THREADS
    before = _tensor_files_in_shm()
    for bad in (np.nan, np.inf, -np.inf):
        poisoned = {**arrays, "layer7.lora_B.weight": arrays["layer7.lora_B.weight"].copy()}
        poisoned["layer7.lora_B.weight"][3, 1] = bad
        with pytest.raises(LoRAAdapterError, match="tensor 'layer7.lora_B.weight' holds NaN or Inf values"):
            TensorFile.from_arrays("x", poisoned)
        assert _tensor_files_in_shm() == before  # the shards written beside it are removed


def test_the_engine_checks_what_the_frontend_could_not():
    finite = {"a": np.ones(3, np.float32), "b": np.ones(2, np.float16), "c": np.ones(2, ml_dtypes.bfloat16)}
    with TensorFile.from_arrays("x", finite) as tensor_file:
        assert tensor_file.checked_finite  # float32 reads these values exactly
    with TensorFile.from_arrays("x", {**finite, "d": np.full(2, 1e300)}) as tensor_file:
        assert not tensor_file.checked_finite  # float64 may overflow on its way to float32: the engine checks
    with TensorFile.from_bytes(save_file_bytes({"a": np.ones(3, np.float32)})) as tensor_file:
        assert not tensor_file.checked_finite  # an HTTP body: the engine checks


def _layout(header: bytes, data: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + data


@pytest.mark.parametrize(
    "layout, problem",
    [
        (b"\x03", "not a valid safetensors file"),
        ((10**6).to_bytes(8, "little") + b"{}", "header longer than the data"),
        (_layout(b"[1]"), "not a JSON object"),
        (_layout(b"{x"), "header"),
        (_layout(b'{"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', bytes(8)), "do not match"),
        (_layout(b'{"t":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}', bytes(16)), "do not match"),
        (_layout(b'{"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}}'), "invalid shape"),
        (_layout(b'{"t":{"dtype":"F32","shape":[2]}}', bytes(8)), "invalid shape or data_offsets"),
        (_layout(b'{"t":[1]}'), "no valid header entry"),
    ],
)
def test_a_malformed_tensor_file_is_refused_with_the_problem_named(layout, problem):
    from sgl_jax_lora.lora.peft_config import LoRAAdapterError

    with TensorFile.from_bytes(layout) as tensor_file:
        with pytest.raises(LoRAAdapterError, match=problem):
            map_tensor_files("x", tensor_file.paths)
