"""lora/safetensors_layout.py reads a safetensors file's layout as the safetensors library does: the same tensors
(names, dtypes, shapes, bytes) from files the library writes, in the header's order, as views of the given bytes (no copy), and a refusal
of every corrupted layout the library refuses too."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors import SafetensorError, deserialize
from safetensors.numpy import save

from sgl_jax_lora.lora.safetensors_layout import SafetensorsLayoutError, safetensors_entries


def file_bytes() -> bytes:
    rng = np.random.default_rng(0)
    tensors = {
        "base_model.model.layers.0.q_proj.lora_A.weight": rng.standard_normal((4, 8)).astype(np.float32),
        "base_model.model.layers.0.q_proj.lora_B.weight": rng.standard_normal((8, 4)).astype(np.float16),
        "counts": np.arange(5, dtype=np.int64),
        "empty": np.zeros((0, 3), np.float64),
        "scalar": np.array(1.5, np.float32),
    }
    return save(tensors, metadata={"format": "pt"})


def test_the_tensors_are_the_librarys_as_views_of_the_bytes():
    data = file_bytes()
    ours = safetensors_entries(data)
    theirs = deserialize(data)
    assert {k: (d, s, bytes(raw)) for k, d, s, raw in ours} == {
        k: (e["dtype"], tuple(e["shape"]), bytes(e["data"])) for k, e in theirs
    }
    assert len(ours) == len(theirs) == 5
    assert all(raw.obj is data for _, _, _, raw in ours)  # views: nothing copied


def with_header(data: bytes, edit) -> bytes:
    """`data` with its header JSON edited by `edit(header) -> header` (the tensor bytes kept)."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    raw = json.dumps(edit(header)).encode()
    return struct.pack("<Q", len(raw)) + raw + data[8 + length :]


A_KEY = "base_model.model.layers.0.q_proj.lora_A.weight"


def entry_edit(field, value):
    def edit(header):
        header[A_KEY][field] = value
        return header

    return lambda data: with_header(data, edit)


def shift_offsets(data):
    def edit(header):
        begin, end = header[A_KEY]["data_offsets"]
        header[A_KEY]["data_offsets"] = [begin + 2, end + 2]
        return header

    return with_header(data, edit)


CORRUPTIONS = {
    "shorter than a header": lambda d: d[:5],
    "header longer than the data": lambda d: struct.pack("<Q", len(d)) + d[8:],
    "header not JSON": lambda d: struct.pack("<Q", 4) + b"{{{{" + d[8:],
    "header a list": lambda d: with_header(d, lambda h: [1, 2]),
    "unknown dtype": entry_edit("dtype", "F7"),
    "negative dimension": entry_edit("shape", [-4, -8]),
    "shape not a list": entry_edit("shape", "4x8"),
    "offsets one number": entry_edit("data_offsets", [0]),
    "offsets off the shape": entry_edit("shape", [4, 9]),
    "tensors overlapping": shift_offsets,
    "data after the tensors": lambda d: d + b"\0" * 8,
    "data cut short": lambda d: d[:-4],
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_layout_the_library_refuses_is_refused(corruption):
    data = CORRUPTIONS[corruption](file_bytes())
    with pytest.raises((SafetensorError, ValueError, TypeError)):
        deserialize(data)
    with pytest.raises(SafetensorsLayoutError):
        safetensors_entries(data)
