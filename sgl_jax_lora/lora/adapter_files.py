"""Adapter files as untrusted input: where they may lie, how they are opened, what their tensors may hold, what an
error may show.

Flow: `/load_lora_adapter` and on-demand loads (LoRAFrontend) -> `confined_dir` (the directory, resolved) -> the
engine process registers it from its config and tensor headers (adapter.inspect_peft_adapter: names, shapes and rank
against the model, each file opened through `open_confined`) -> adapter_value_check.check_adapter_files on a
frontend worker thread (config and weights resolved with os.path.realpath and required inside --lora-allowed-dirs;
every LoRA tensor finite; a refusal unloads it again) -> requests may name it; the engine's loader opens each file
again when it reads the weights and refuses NaN and Inf there too (`read_checked_safetensors`; the files may have
changed since).
safetensors_layout.py checks the bytes' layout, returning views, copying nothing.

A symlink is followed when the path is resolved, and what it points to must itself lie inside an allowed
directory. Between that check and the open, a client with write access to an allowed directory could swap the
file, or a directory above it, for a symlink out; so `open_confined` walks the resolved path from the allowed
directory down, one component at a time relative to the directory already opened, with O_NOFOLLOW on each: a
symlink that appeared since the check fails the open instead of being followed. The opened file must be a
regular file with the st_dev/st_ino the checked path had (a file renamed over it is refused too); O_NONBLOCK
keeps a FIFO swapped in from blocking the open. Callers read the bytes through that one file object (safetensors
and JSON from bytes) and never reopen the path. Without allowed directories (the operator's own adapters) the
resolved path is opened with O_NOFOLLOW and checked the same way.

Errors name the adapter, the file (as the client spelled it), the field or tensor and the fix; they never quote
what a file contains.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import ml_dtypes
import numpy as np

from sgl_jax_lora.lora.safetensors_layout import (
    SafetensorsLayoutError,
    read_header,
    safetensors_layout,
)
from sgl_jax_lora.utils.shown_text import cut

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PARALLEL_CHECK_BYTES = 16 << 20  # adapters smaller than this are checked on the calling thread
CHECK_THREADS = 8
MAX_SHOWN_CHARS = 64  # names and paths quoted in errors are cut to this many characters


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter, the problem and the fix."""


def adapter_error(name: str, problem: str, fix: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"adapter '{shown(name)}': {problem}; {fix}")


def shown(text: str) -> str:
    """`text` cut for an error message (a client may send a megabyte-long name)."""
    return cut(text, MAX_SHOWN_CHARS)


def is_within(path: str, allowed_dirs: list[str] | tuple[str, ...]) -> bool:
    """Whether `path` (already resolved) lies strictly inside one of `allowed_dirs` (resolved here)."""
    for allowed in allowed_dirs:
        root = os.path.realpath(allowed)
        if path.startswith(root.rstrip(os.sep) + os.sep):
            return True
    return False


def real_path(name: str, path: str) -> str:
    """`path` resolved (os.path.realpath); an adapter error where it changed while it was resolved (a component
    swapped between a symlink and a file: realpath's readlink fails)."""
    try:
        return os.path.realpath(path)
    except OSError:
        raise adapter_error(
            name,
            f"path '{shown(path)}' changed while it was resolved (a symlink in it was replaced)",
            "load the adapter again once its files are no longer being changed",
        ) from None


def confined_dir(name: str, path: str, allowed_dirs: list[str] | tuple[str, ...]) -> str:
    """The resolved adapter directory, refused unless it lies inside an allowed directory."""
    real = real_path(name, path)
    if not is_within(real, allowed_dirs) or not os.path.isdir(real):
        raise adapter_error(
            name,
            f"path '{shown(path)}' is not an adapter directory inside the directories the operator allowed",
            "restart with --lora-allowed-dirs DIR containing it, or register it with --lora-paths",
        )
    return real


def confined_file(name: str, path: str, allowed_dirs: list[str] | tuple[str, ...] | None) -> str:
    """`path` resolved (symlinks followed); with `allowed_dirs`, refused unless the target lies inside one."""
    real = real_path(name, path)
    if allowed_dirs is not None and not is_within(real, allowed_dirs):
        raise adapter_error(
            name,
            f"{os.path.basename(path)} resolves (through a symlink) to a file outside "
            "the directories the operator allowed",
            "copy the file into the adapter directory instead of linking to it",
        )
    return real


SYMLINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR, getattr(errno, "EMLINK", -1))  # O_NOFOLLOW met a symlink
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


@contextlib.contextmanager
def open_confined(name: str, path: str, allowed_dirs: list[str] | tuple[str, ...] | None) -> Iterator[BinaryIO]:
    """`path` opened for reading (binary): resolved and checked inside `allowed_dirs` (None: anywhere), then opened
    without following any symlink and verified to be the very file that was checked. Raises LoRAAdapterError."""
    real = confined_file(name, path, allowed_dirs)
    shown_name = os.path.basename(path)
    try:
        checked = os.stat(real)
        fd = open_no_symlinks(real, allowed_dirs)
    except OSError as e:
        raise _changed_error(name, shown_name, e) from None
    with os.fdopen(fd, "rb") as f:
        opened = os.fstat(f.fileno())
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino):
            raise adapter_error(
                name,
                f"{shown_name} was replaced while it was being opened (or is not a regular file)",
                "load the adapter again once its files are no longer being changed",
            )
        yield f


def open_no_symlinks(real: str, allowed_dirs: list[str] | tuple[str, ...] | None) -> int:
    """A read-only fd of the resolved path `real`, following no symlink below the allowed directory holding it."""
    root = _root_of(real, allowed_dirs)
    if root is None:
        return os.open(real, _FILE_FLAGS)
    parts = os.path.relpath(real, root).split(os.sep)
    dir_fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))  # the operator's directory: followed
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
        return os.open(parts[-1], _FILE_FLAGS, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _root_of(real: str, allowed_dirs: list[str] | tuple[str, ...] | None) -> str | None:
    for allowed in allowed_dirs or ():
        root = os.path.realpath(allowed)
        if is_within(real, [root]):
            return root
    return None


def _changed_error(name: str, shown_name: str, error: OSError) -> LoRAAdapterError:
    if error.errno in (errno.EMFILE, errno.ENFILE):  # the server's fault, not the files'
        problem = f"{shown_name} could not be opened: the server has no open file left ({errno.errorcode[error.errno]})"
        return adapter_error(name, problem, "retry when fewer connections are open, or raise the open-file limit")
    return adapter_error(
        name,
        f"{shown_name} could not be opened as the file that was checked ({type(error).__name__}"
        f"{': a symlink appeared in its path' if error.errno in SYMLINK_ERRNOS else ''})",
        "load the adapter again once its files are no longer being changed",
    )


def refuse_non_finite(name: str, key: str, tensor: np.ndarray, in_memory: bool = False) -> None:
    """Raise if `tensor` holds NaN or Inf: one such value would make every token through its slot NaN. `in_memory`:
    the tensor was handed over as an array (load from tensors, update), not read from an adapter's file."""
    if tensor.dtype.kind in "fc" or tensor.dtype.name == "bfloat16":
        if not np.isfinite(np.sum(tensor)) and not np.isfinite(tensor).all():  # the sum: one pass, no mask
            raise non_finite_error(name, key, in_memory)


def non_finite_error(name: str, key: str, in_memory: bool = False) -> LoRAAdapterError:
    if in_memory:
        return adapter_error(
            name,
            f"{tensor_label(key)} holds NaN or Inf values",
            "fix the training step that produced them (e.g. a diverged loss) and send finite weights",
        )
    return adapter_error(
        name,
        f"{tensor_label(key)} in {WEIGHTS_FILE} holds NaN or Inf values",
        "fix the training run (or the conversion) that produced them and re-save the adapter",
    )


def refuse_any_non_finite(name: str, tensors: dict[str, np.ndarray], in_memory: bool = False) -> None:
    """`refuse_non_finite` on every tensor; a large adapter's tensors are checked on several threads (numpy releases
    the GIL in its reductions: 168 MB in 17 ms on 8 threads against 34 ms on one on the H100 machine's CPUs)."""
    check = refuse_non_finite  # the module's name, looked up at call time: tests may bypass it
    if in_memory:
        check = functools.partial(check, in_memory=True)
    total = sum(t.nbytes for t in tensors.values())
    if total < PARALLEL_CHECK_BYTES or len(tensors) < 2:
        for key, tensor in tensors.items():
            check(name, key, tensor)
        return
    with ThreadPoolExecutor(min(CHECK_THREADS, len(tensors)), thread_name_prefix="finite-check") as pool:
        for future in [pool.submit(check, name, key, tensor) for key, tensor in tensors.items()]:
            future.result()  # the first failure, in tensor order


def tensor_label(key: str, what: str = "tensor") -> str:
    """How an error names a tensor (or module path) read from a safetensors header: by its name when that is a
    dotted identifier of at most 200 characters, the form every model's tensor names have, else without it; so an
    error never echoes free text from a file."""
    if _DOTTED_NAME.fullmatch(key):
        return f"{what} '{key}'"
    return f"a {what} whose name is not a dotted identifier"


_DOTTED_NAME = re.compile(r"[A-Za-z0-9_.]{1,200}")
Layout = tuple[memoryview, list[tuple[str, str, tuple[int, ...], int, int]]]  # safetensors_layout's result
_VIEW_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
KEPT_FLOAT_DTYPES = frozenset(_VIEW_DTYPES.values())  # held as given; other floats become float32
FLOAT_ITEMSIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}  # bytes per element of the float dtypes LoRA takes


def read_checked_safetensors(name: str, data: bytes, layout: Layout | None = None) -> dict[str, np.ndarray]:
    """A safetensors file's bytes -> name -> array (`float_tensor`: F32, F16 and BF16 as they are, F64 as float32),
    every tensor refused if it holds NaN or Inf: the engine's read of an adapter file (`layout`: the one
    `read_weights_file` found in the same bytes, not parsed again). Tensors of one dtype are summed
    (in float32) in one numpy call, and checked one by one (`refuse_any_non_finite`, which names the first bad tensor)
    only when that sum is not finite. A thread that reads beside a busy engine loop waits for the GIL after every
    numpy call, so the calls' number matters more than their size (docs/benchmarks.md "Adapter load")."""
    tensors, whole = _float_tensors(name, data, layout)
    if whole is None or not np.isfinite(np.sum(whole, dtype=np.float32)):
        refuse_any_non_finite(name, tensors)
    return tensors


def _float_tensors(
    name: str, data: bytes, layout: Layout | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """(name -> array, the one array they are all views of, or None when the file mixes dtypes)."""
    try:
        region, entries = layout if layout is not None else safetensors_layout(data)
    except SafetensorsLayoutError as e:
        raise _invalid_safetensors(name, e) from e
    dtypes = {dtype for _, dtype, _, _, _ in entries}
    if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_ITEMSIZES:
        tensors = {key: float_tensor(name, key, dtype, shape, region[b:e]) for key, dtype, shape, b, e in entries}
        return tensors, None
    dtype = dtypes.pop()
    size = FLOAT_ITEMSIZES[dtype]
    whole = float_tensor(name, entries[0][0], dtype, (len(region) // size,), region)  # one element per file element
    return {key: whole[b // size : e // size].reshape(shape) for key, _, shape, b, e in entries}, whole


def _invalid_safetensors(name: str, error: SafetensorsLayoutError) -> LoRAAdapterError:
    return adapter_error(
        name,
        f"the tensors are not a valid safetensors file ({error})",
        "send or save the bytes of safetensors' save_file/save (e.g. adapter_model.safetensors)",
    )


def float_tensor(name: str, key: str, dtype: str, shape: tuple[int, ...], raw) -> np.ndarray:
    """One safetensors entry (its dtype name, shape and raw bytes or buffer slice) -> an array in the entry's own
    dtype: F32, F16 and BF16 are views of `raw` (read-only over bytes, writable over a file read into a buffer), F64
    is converted to float32. Kept 16-bit, an adapter takes half the host memory of float32 and is laid out for a slot
    with one cast (the values the same as through float32: widening a 16-bit float is exact). Disk, HTTP bodies and
    TensorFiles share it."""
    if dtype in _VIEW_DTYPES:
        return np.frombuffer(raw, _VIEW_DTYPES[dtype]).reshape(shape)
    if dtype == "F64":
        return np.frombuffer(raw, np.float64).astype(np.float32).reshape(shape)
    raise non_float_error(name, key, dtype)


def non_float_error(name: str, key: str, dtype: object) -> LoRAAdapterError:
    return adapter_error(
        name,
        f"{tensor_label(key)} has dtype {shown(str(dtype))}",
        "LoRA tensors must be floating point (F32, F16, BF16 or F64)",
    )


def read_safetensors_shapes(name: str, f: BinaryIO) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header, reading no tensor data: registration validates shapes in
    milliseconds however large the adapter. The file's size must be what the header describes."""
    return {key: shape for key, _, shape, _, _ in read_header_checked(name, f)[1]}


def read_weights_file(
    name: str, f: BinaryIO, check_shapes: Callable[[dict[str, tuple[int, ...]]], None] | None = None
) -> tuple[np.ndarray, Layout]:
    """(a safetensors file's whole bytes (uint8), their layout: the data region and the header's entries), read header
    first: the file's size checked against the header, then `check_shapes(name -> shape)` (the caller's validation
    against the model), and only then the tensors, so a file of more bytes than a valid adapter holds is refused
    before they are read. The header read is the one the buffer holds, so its layout is not parsed again. The buffer
    is allocated unfilled and filled by one read that releases the GIL: a zero-filled bytearray held the GIL for its
    whole size (45-58 ms of an 84 MB adapter on the 2-core CPU machine), which the engine loop waited out beside
    every cold adapter's read."""
    head, entries = read_header_checked(name, f)
    if check_shapes is not None:
        check_shapes({key: shape for key, _, shape, _, _ in entries})
    data_len = max((end for *_, end in entries), default=0)
    data = np.empty(len(head) + data_len, np.uint8)
    data[: len(head)] = np.frombuffer(head, np.uint8)
    region = memoryview(data)[len(head) :]
    if f.readinto(region) != data_len:
        raise adapter_error(
            name, f"{WEIGHTS_FILE} ended early (it changed while it was read)", "load the adapter again later"
        )
    return data, (region, entries)


def read_header_checked(name: str, f: BinaryIO) -> tuple[bytes, list[tuple[str, str, tuple[int, ...], int, int]]]:
    """safetensors_layout.read_header, its refusal an adapter error naming the file and the fix."""
    try:
        return read_header(f)
    except SafetensorsLayoutError as e:
        raise adapter_error(
            name,
            f"{WEIGHTS_FILE} is not a valid safetensors file ({e})",
            "re-save the adapter with peft's save_pretrained (safe_serialization=True)",
        ) from None


# PEFT's name of a LoRA half: "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight", optionally with the
# adapter's tag ("...lora_A.default.weight"); lora/tensor_names.py takes the module path from it
LORA_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?P<path>.+)\.(?P<kind>lora_A|lora_B)(?:\.(?P<tag>[^.]+))?\.weight$"
)
