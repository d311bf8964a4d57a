"""TensorFile: adapter tensors on their way from the frontend to the engine process, through shared memory.

Flow: Engine.load_lora_adapter_from_tensors / update_lora_adapter (arrays) or the HTTP routes (a safetensors
file's bytes) write files in safetensors layout under /dev/shm (`TensorFile.from_arrays` / `.from_bytes`, one
copy, mode 0600, names the server picks) -> the RPC carries only their paths -> the engine maps them
(`map_tensor_files`): float32, float16 and bfloat16 tensors become read-only views of the mappings in their dtype,
with no copy and no pipe transfer of the payload, and live as long as the host adapter built from them. The frontend
removes the files when the call returns; the mappings outlive the names. A client never names these files: they are
the server's own.

Arrays are written as up to WRITE_THREADS files (shards, each a subset of the tensors) on as many threads: writes
into one tmpfs file take its inode lock one at a time, writes into several files run side by side (168 MB in
33 ms on 8 threads against 83 ms in one file on the H100 machine's CPUs). An HTTP body is one file, as it came.

Each writer thread refuses a tensor holding NaN or Inf just before writing it (the array is then in the CPU's cache
for the write), so arrays of the float dtypes the engine reads exactly (float32, float16, bfloat16) arrive checked:
`checked_finite` tells the engine to skip its own pass. float64 arrays (whose float32 conversion may overflow) and
HTTP bodies are checked by the engine.

The layout is safetensors' (8-byte little-endian header length, a JSON header of dtype / shape / data offsets,
the raw data), checked by safetensors_layout.py (every offset and size), since HTTP bodies arrive in it unchanged.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from sgl_jax_lora.lora.adapter_files import (
    float_tensor,
    refuse_non_finite,
    tensor_label,
)
from sgl_jax_lora.lora.peft_config import adapter_error
from sgl_jax_lora.lora.safetensors_layout import SafetensorsLayoutError, safetensors_entries

_SHM_DIR = "/dev/shm"
WRITE_THREADS = 8  # most shard files of one TensorFile, written on as many threads
MIN_SHARD_BYTES = 8 << 20  # smaller payloads are not worth a thread
_FIX = "send the bytes of safetensors' save_file/save (e.g. adapter_model.safetensors)"


class TensorFile:
    """Safetensors-layout files in shared memory (one or several shards of the tensors), owned by the frontend until
    `remove()` (or the `with` exit)."""

    def __init__(self, paths: list[str], checked_finite: bool = False):
        self.paths = paths
        self.checked_finite = checked_finite  # every tensor was found finite as the engine will read it

    @classmethod
    def from_bytes(cls, data: bytes) -> TensorFile:
        """An HTTP body (a safetensors file's bytes) as a TensorFile; the engine validates it."""
        fd, path = _new_file()
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except BaseException:
            os.unlink(path)
            raise
        return cls([path])

    @classmethod
    def from_arrays(cls, name: str, tensors: dict) -> TensorFile:
        """PEFT tensor names -> float arrays (numpy or JAX; float32, float16, bfloat16, float64), written as they
        are (no conversion): the engine reads each dtype. Raises LoRAAdapterError (nothing left behind) if a tensor
        holds NaN or Inf."""
        arrays = _float_arrays(name, tensors)
        checked_finite = all(a.dtype.itemsize < 8 for a in arrays.values())
        total = sum(a.nbytes for a in arrays.values())
        num_shards = max(1, min(WRITE_THREADS, len(arrays), total // MIN_SHARD_BYTES))
        shards: list[dict[str, np.ndarray]] = [{} for _ in range(num_shards)]
        sizes = [0] * num_shards
        for key, value in sorted(arrays.items(), key=lambda item: -item[1].nbytes):  # balanced by bytes
            smallest = sizes.index(min(sizes))
            shards[smallest][key] = value
            sizes[smallest] += value.nbytes
        if num_shards == 1:
            return cls([_write_shard(name, shards[0])], checked_finite)
        with ThreadPoolExecutor(num_shards, thread_name_prefix="tensor-file") as pool:
            futures = [pool.submit(_write_shard, name, shard) for shard in shards]
        paths = [f.result() for f in futures if f.exception() is None]
        if len(paths) < num_shards:  # a non-finite tensor, /dev/shm full: leave nothing behind
            cls(paths).remove()
            next(f for f in futures if f.exception() is not None).result()
        return cls(paths, checked_finite)

    def remove(self) -> None:
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _write_shard(name: str, arrays: dict[str, np.ndarray]) -> str:
    """One safetensors-layout file of these arrays (data 8-byte aligned, as safetensors writes it), each checked
    finite just before it is written; -> its path."""
    header, offset = {}, 0
    for key, value in arrays.items():
        dtype = "BF16" if value.dtype.name == "bfloat16" else {4: "F32", 2: "F16", 8: "F64"}[value.dtype.itemsize]
        header[key] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [offset, offset + value.nbytes]}
        offset += value.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    data_start = 8 + len(header_bytes)
    fd, path = _new_file()
    try:
        os.ftruncate(fd, data_start + offset)
        os.pwrite(fd, len(header_bytes).to_bytes(8, "little") + header_bytes, 0)
        for key, value in arrays.items():
            refuse_non_finite(name, key, value, in_memory=True)
            _write_at(fd, value, data_start + header[key]["data_offsets"][0])
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


def map_tensor_files(name: str, paths: list[str]) -> dict[str, np.ndarray]:
    """The engine's side of a TensorFile: tensor name -> float32 array over all its shards. Raises LoRAAdapterError
    if a shard is not valid safetensors or two shards hold the same tensor."""
    tensors: dict[str, np.ndarray] = {}
    for path in paths:
        shard = map_tensor_file(name, path)
        repeated = next((key for key in shard if key in tensors), None)
        if repeated is not None:
            raise adapter_error(name, f"{tensor_label(repeated)} is given twice", _FIX)
        tensors.update(shard)
    return tensors


def map_tensor_file(name: str, path: str) -> dict[str, np.ndarray]:
    """One shard: tensor name -> array (F32, F16 and BF16 entries are read-only views of the mapping in their dtype;
    F64 is converted to float32). Raises LoRAAdapterError naming the problem if the layout is not valid safetensors."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise adapter_error(name, f"the tensors are not a valid safetensors file ({size} bytes)", _FIX)
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        entries = safetensors_entries(memoryview(mapping))
    except SafetensorsLayoutError as e:
        raise adapter_error(name, f"the tensors are not a valid safetensors file ({e})", _FIX) from e
    # read-only views of the mapping, which stays alive as long as the arrays do
    return {key: float_tensor(name, key, dtype, shape, raw) for key, dtype, shape, raw in entries}


def _write_at(fd: int, value: np.ndarray, start: int) -> None:
    data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    written = 0
    while written < data.size:  # pwrite may write less than asked
        written += os.pwrite(fd, data[written:], start + written)


def _float_arrays(name: str, tensors: dict) -> dict[str, np.ndarray]:
    if not isinstance(tensors, dict) or not tensors:
        raise adapter_error(name, "no tensors given", "pass a non-empty dict of PEFT tensor names to arrays")
    arrays = {}
    for key, value in tensors.items():
        array = _host_array(value)
        is_float = array.dtype.name == "bfloat16" or (array.dtype.kind == "f" and array.dtype.itemsize in (2, 4, 8))
        if not isinstance(key, str) or not is_float:
            raise adapter_error(
                name,
                f"tensor {key!r} is not a floating-point array (dtype {array.dtype})",
                "pass float arrays keyed by PEFT names (e.g. '...q_proj.lora_A.weight')",
            )
        arrays[key] = array.astype(array.dtype.newbyteorder("<"), copy=False)  # safetensors data is little-endian
    return arrays


def _host_array(value: object) -> np.ndarray:
    """A numpy view of a numpy, JAX or torch array (torch: detached, on the host; bfloat16, which numpy cannot take
    from torch, as float32), anything else as numpy reads it."""
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu()
        value = value.float() if str(value.dtype) == "torch.bfloat16" else value
        return value.numpy()
    return np.asarray(value)


def _new_file() -> tuple[int, str]:
    directory = _SHM_DIR if os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK) else None
    return tempfile.mkstemp(prefix="sgl-jax-lora-tensors-", suffix=".safetensors", dir=directory)
