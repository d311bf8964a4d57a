"""The layout of a safetensors file's bytes, checked and returned as views: no tensor is copied.

Flow: adapter_files.read_checked_safetensors (the engine reading an adapter),
adapter_value_check.check_adapter_files (the frontend) and tensor_file.map_tensor_file (the engine mapping a
TensorFile) -> `safetensors_layout(data)` (the data region and each tensor's offsets in it) or
`safetensors_entries(data)` ([(name, dtype, shape, memoryview of its bytes)]), or `SafetensorsLayoutError` saying
what is wrong. A file is read header first (`read_header`, checked against the file's size), so that no more bytes
are read than its header names. The checks are the safetensors library's: an 8-byte little-endian header length, a
JSON object of entries (and an optional `__metadata__`), each with a known dtype, a shape of non-negative integers and
data_offsets whose span is the shape times the dtype's size, the entries back to back from the start of the data to
its end.

Why not the library's `deserialize`: it copies every tensor into a new bytes object while it holds the GIL (an 84 MB
adapter: 67 ms on the 2-core CPU machine, in which no other thread of the process runs, the engine loop's included).
Views of `data` leave the copies (or the casts) to numpy, which releases the GIL.
"""

from __future__ import annotations

import json
import math
import os
from typing import BinaryIO

MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit on a header

# bytes per element of every dtype the safetensors format names
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class SafetensorsLayoutError(ValueError):
    """The bytes are not a valid safetensors file; the message says what is wrong, never what the file holds."""


def safetensors_entries(data: bytes | memoryview) -> list[tuple[str, str, tuple[int, ...], memoryview]]:
    """(name, dtype, shape, bytes of the tensor as a view of `data`) for every tensor, in the header's order."""
    region, entries = safetensors_layout(data)
    return [(key, dtype, shape, region[begin:end]) for key, dtype, shape, begin, end in entries]


def safetensors_layout(data: bytes | memoryview) -> tuple[memoryview, list[tuple[str, str, tuple[int, ...], int, int]]]:
    """(the data after the header as a view of `data`, [(name, dtype, shape, begin, end)] in the header's order, the
    offsets into that view). The tensors lie back to back, so one call can convert them all at once."""
    view = memoryview(data)
    if len(view) < 8:
        raise SafetensorsLayoutError(f"{len(view)} bytes, shorter than a header")
    header_len = _header_length(view[:8], len(view))
    region = view[8 + header_len :]
    return region, header_entries(bytes(view[8 : 8 + header_len]), len(region))


def read_header(f: BinaryIO) -> tuple[bytes, list[tuple[str, str, tuple[int, ...], int, int]]]:
    """(the file's first bytes up to the end of its header, its entries as `safetensors_layout` gives them), read
    from `f` at its start and checked against the file's size before any tensor is read: a file larger or smaller
    than its header describes is refused here, so a caller reads no more than the tensors the header names."""
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    if len(prefix) < 8:
        raise SafetensorsLayoutError(f"{len(prefix)} bytes, shorter than a header")
    header_len = _header_length(prefix, size)
    raw = f.read(header_len)
    if len(raw) != header_len:
        raise SafetensorsLayoutError("the file ended inside its header (it changed while it was read)")
    return prefix + raw, header_entries(raw, size - 8 - header_len)


def _header_length(prefix: bytes | memoryview, total: int) -> int:
    header_len = int.from_bytes(prefix, "little")
    if header_len > MAX_HEADER_BYTES or header_len > total - 8:
        raise SafetensorsLayoutError("header longer than the data")
    return header_len


def header_entries(raw: bytes, data_len: int) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """The entries of a header's JSON bytes, checked against a data region of `data_len` bytes: each a known dtype,
    its shape's size, all back to back from the region's start to its end."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep for json
        raise SafetensorsLayoutError("header is not JSON") from None
    if not isinstance(header, dict):
        raise SafetensorsLayoutError("header is not a JSON object")
    header.pop("__metadata__", None)
    entries = [(key, *_entry(key, entry, data_len)) for key, entry in header.items()]
    position = 0
    for *_, begin, end in sorted(entries, key=lambda e: (e[3], e[4])):
        if begin != position:
            raise SafetensorsLayoutError("tensors overlap or leave a gap in the data")
        position = end
    if position != data_len:
        raise SafetensorsLayoutError(f"the data is {data_len} bytes, but its tensors take {position}")
    return entries


def _entry(key: str, entry: object, data_len: int) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(key, str) or not isinstance(entry, dict) or entry.get("dtype") not in DTYPE_SIZES:
        raise SafetensorsLayoutError("a tensor has no valid header entry (a known dtype, a shape, data_offsets)")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise SafetensorsLayoutError("a tensor has an invalid shape (a list of non-negative integers)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise SafetensorsLayoutError("a tensor has an invalid shape or data_offsets (two non-negative integers)")
    begin, end = offsets
    if not begin <= end <= data_len or end - begin != math.prod(shape) * DTYPE_SIZES[entry["dtype"]]:
        raise SafetensorsLayoutError("a tensor's data_offsets do not match its shape and dtype")
    return entry["dtype"], tuple(shape), begin, end


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
