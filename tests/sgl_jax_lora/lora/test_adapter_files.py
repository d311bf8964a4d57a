"""Adapter files as untrusted input (lora/adapter_files.py and the loader): non-finite tensors are refused, every
file an adapter opens must resolve inside the allowed directories, and errors never quote a file's contents.

Adapters are real PEFT directories (tests/support/peft_fixtures.py); symlinks are real symlinks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sgl_jax_lora.lora import adapter_files, adapter_value_check, safetensors_layout
from sgl_jax_lora.lora.adapter import inspect_peft_adapter, load_peft_adapter
from sgl_jax_lora.lora.adapter_files import confined_dir
from sgl_jax_lora.lora.adapter_value_check import check_adapter_files, raw_holds_non_finite
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.lora.target_shapes import LoRATargetShapes
from tests.support.peft_fixtures import make_tiny_llama_dir, poison_adapter, write_peft_adapter

SECRET = "s3cr3t-value-from-outside"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def shapes(base_dir: Path) -> LoRATargetShapes:
    return LoRATargetShapes.from_hf_config(json.loads((base_dir / "config.json").read_text()))


@pytest.fixture(scope="module")
def clean_adapter(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_peft_adapter(base_dir, tmp_path_factory.mktemp("clean") / "a", seed=1, r=4)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    return allowed, outside


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize(
    "dtype", [None, torch.bfloat16, torch.float16, torch.float64], ids=["f32", "bf16", "f16", "f64"]
)
def test_non_finite_tensor_is_refused_naming_adapter_and_tensor(clean_adapter, shapes, tmp_path, value, dtype):
    bad = shutil.copytree(clean_adapter, tmp_path / "bad")
    key = poison_adapter(bad, value, dtype)
    for check in (
        lambda: load_peft_adapter("poisoned", str(bad), shapes),
        lambda: check_adapter_files("poisoned", str(bad), None),
    ):
        with pytest.raises(LoRAAdapterError) as err:
            check()
        message = str(err.value)
        assert "adapter 'poisoned'" in message and key in message and "NaN or Inf" in message
    # the clean original still loads, and header-only registration cannot see values (the weights' read does)
    assert load_peft_adapter("clean", str(clean_adapter), shapes).rank == 4
    assert inspect_peft_adapter("poisoned", str(bad), shapes).rank == 4


@pytest.mark.parametrize("chunk", [64, 1000 * 8], ids=["chunks-inside-tensors", "chunks-across-tensors"])
def test_the_chunked_check_names_the_bad_tensor_wherever_it_lies(clean_adapter, tmp_path, monkeypatch, chunk):
    """The frontend reads a run of back-to-back tensors of one dtype a chunk at a time (a chunk may hold parts of
    several): a NaN in any tensor, first, last or across a chunk's edge, where a float32 run meets a float16 one,
    is refused naming that tensor; a tensor that is not a LoRA half ends a run and is not read."""
    monkeypatch.setattr(adapter_value_check, "CHECK_CHUNK_BYTES", chunk)
    bad = shutil.copytree(clean_adapter, tmp_path / "bad")
    weights = str(bad / "adapter_model.safetensors")
    tensors = {k: v.to(torch.float16) if "q_proj" in k else v for k, v in load_file(weights).items()}
    # safetensors orders a file by dtype, then name: the float32 halves, this one, then the float16 halves
    save_file({**tensors, "notes.weight": torch.full((4,), float("nan"))}, weights)
    check_adapter_files("bad", str(bad), None)
    for key in tensors:
        poisoned = {k: v.clone() for k, v in tensors.items()}
        poisoned[key].view(-1)[-1] = float("nan")
        save_file(poisoned, weights)  # float32 halves straight before the float16 ones
        with pytest.raises(LoRAAdapterError, match=re.escape(key) + ".*NaN or Inf"):
            check_adapter_files("bad", str(bad), None)


def test_float64_values_beyond_float32_are_refused_at_the_check(clean_adapter, tmp_path):
    """Finite in float64, Inf once served in 32 bits or fewer: the frontend's check refuses the adapter, where it
    used to register and then fail every request."""
    big = shutil.copytree(clean_adapter, tmp_path / "big")
    weights = big / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k: v.to(torch.float64) * (1e300 if "lora_B" in k else 1.0) for k, v in tensors.items()}, weights)
    with pytest.raises(LoRAAdapterError, match=r"adapter 'big'.*lora_B.*beyond float32's range"):
        check_adapter_files("big", str(big), None)
    save_file({k: v.to(torch.float64) for k, v in tensors.items()}, weights)  # float64 in range passes
    check_adapter_files("big", str(big), None)


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
def test_raw_bits_check_agrees_with_isfinite(dtype):
    """The frontend's check on a file's raw bits finds NaN and Inf of either sign, and nothing else: not the largest
    finite values, subnormals or zeros, in tensors longer than one pass of the check."""
    numpy_dtype = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64}[dtype]
    info = ml_dtypes.finfo(numpy_dtype) if dtype == "BF16" else np.finfo(numpy_dtype)
    edge = np.array([info.max, -info.max, info.smallest_subnormal, -0.0, 0.0, 1.0], numpy_dtype)
    clean = np.concatenate([edge, np.ones(adapter_value_check._RAW_CHECK_ELEMENTS + 5, numpy_dtype)])
    assert not raw_holds_non_finite(dtype, clean.tobytes())
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, clean.size - 1):  # in the first pass and in the last
            poisoned = clean.copy()
            poisoned[at] = bad
            assert raw_holds_non_finite(dtype, poisoned.tobytes()), (bad, at)


def test_symlinked_weights_outside_the_allowed_dirs_are_refused(clean_adapter, shapes, dirs):
    allowed, outside = dirs
    shutil.copy(clean_adapter / "adapter_model.safetensors", outside / "adapter_model.safetensors")
    adapter = allowed / "a"
    adapter.mkdir()
    shutil.copy(clean_adapter / "adapter_config.json", adapter / "adapter_config.json")
    os.symlink(outside / "adapter_model.safetensors", adapter / "adapter_model.safetensors")
    assert confined_dir("a", str(adapter), [str(allowed)]) == os.path.realpath(adapter)  # the directory itself is fine
    for check in (
        lambda: check_adapter_files("a", str(adapter), [str(allowed)]),
        lambda: inspect_peft_adapter("a", str(adapter), shapes, allowed_dirs=[str(allowed)]),
        lambda: load_peft_adapter("a", str(adapter), shapes, allowed_dirs=[str(allowed)]),
    ):
        with pytest.raises(LoRAAdapterError, match="adapter_model.safetensors resolves .* outside the directories"):
            check()
    # the operator's own adapters (--lora-paths: no allowed_dirs) may link anywhere
    assert load_peft_adapter("a", str(adapter), shapes).rank == 4


def test_symlinked_config_outside_is_refused_without_quoting_it(clean_adapter, shapes, dirs):
    allowed, outside = dirs
    config = json.loads((clean_adapter / "adapter_config.json").read_text())
    (outside / "secret.json").write_text(json.dumps({**config, "peft_type": SECRET}))
    adapter = allowed / "a"
    adapter.mkdir()
    shutil.copy(clean_adapter / "adapter_model.safetensors", adapter / "adapter_model.safetensors")
    os.symlink(outside / "secret.json", adapter / "adapter_config.json")
    for check in (
        lambda: check_adapter_files("a", str(adapter), [str(allowed)]),
        lambda: inspect_peft_adapter("a", str(adapter), shapes, allowed_dirs=[str(allowed)]),
    ):
        with pytest.raises(LoRAAdapterError) as err:
            check()
        assert "adapter_config.json resolves" in str(err.value) and SECRET not in str(err.value)


def test_a_symlinked_directory_must_resolve_inside(clean_adapter, dirs):
    allowed, outside = dirs
    shutil.copytree(clean_adapter, outside / "a")
    os.symlink(outside / "a", allowed / "escape")
    with pytest.raises(LoRAAdapterError, match="not an adapter directory inside"):
        confined_dir("escape", str(allowed / "escape"), [str(allowed)])
    shutil.copytree(clean_adapter, allowed / "real")
    os.symlink(allowed / "real", allowed / "alias")  # a link that stays inside is followed
    assert confined_dir("alias", str(allowed / "alias"), [str(allowed)]) == os.path.realpath(allowed / "real")
    check_adapter_files("alias", str(allowed / "alias"), [str(allowed)])


# (field, value) written into adapter_config.json; each must be refused naming the field, never quoting the value
BAD_CONFIG_FIELDS = [
    ("peft_type", SECRET),
    ("r", SECRET),
    ("lora_alpha", SECRET),
    ("target_modules", [SECRET]),
    ("target_modules", "(" + SECRET),
    ("rank_pattern", {"(" + SECRET: 4}),
    ("rank_pattern", {"q_proj": SECRET}),
    ("alpha_pattern", {"q_proj": SECRET}),
    ("rank_pattern", SECRET),
    ("layers_to_transform", [SECRET]),
    ("layers_pattern", {SECRET: 1}),
    ("exclude_modules", {SECRET: 1}),
    ("bias", SECRET),
    ("modules_to_save", [SECRET]),
    ("trainable_token_indices", [SECRET]),
    ("target_parameters", [SECRET]),
]


@pytest.mark.parametrize(
    "field,value", BAD_CONFIG_FIELDS, ids=[f"{f}-{type(v).__name__}-{i}" for i, (f, v) in enumerate(BAD_CONFIG_FIELDS)]
)
def test_config_errors_name_the_field_never_its_value(clean_adapter, shapes, tmp_path, field, value):
    adapter = shutil.copytree(clean_adapter, tmp_path / "a")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(LoRAAdapterError) as err:
        inspect_peft_adapter("a", str(adapter), shapes)
    message = str(err.value)
    assert field in message and SECRET not in message and "s3cr3t" not in message


def test_unreadable_config_and_long_names_are_not_echoed(clean_adapter, shapes, tmp_path):
    adapter = shutil.copytree(clean_adapter, tmp_path / "long")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "X" * 100_000}))
    with pytest.raises(LoRAAdapterError) as err:
        inspect_peft_adapter("n" * 10_000, str(adapter), shapes)
    assert "peft_type is not LORA" in str(err.value) and len(str(err.value)) < 400
    (adapter / "adapter_config.json").write_text('{"peft_type": "' + SECRET)  # truncated JSON
    with pytest.raises(LoRAAdapterError, match=r"not valid JSON \(line 1") as err:
        inspect_peft_adapter("a", str(adapter), shapes)
    assert SECRET not in str(err.value)


def test_tensor_names_are_shown_only_as_dotted_identifiers(clean_adapter, shapes, tmp_path):
    adapter = shutil.copytree(clean_adapter, tmp_path / "a")
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file({**tensors, f"{SECRET} = 'hunter2'": torch.zeros(2)}, str(weights))
    for check in (
        lambda: load_peft_adapter("a", str(adapter), shapes),
        lambda: inspect_peft_adapter("a", str(adapter), shapes),
    ):
        with pytest.raises(
            LoRAAdapterError,
            match="unexpected tensor in adapter_model.safetensors: a tensor whose name is not a dotted identifier",
        ) as err:
            check()
        assert SECRET not in str(err.value) and "hunter2" not in str(err.value)


# ---- the file swapped between the confinement check and the open (adapter_files.open_confined) ----------------
def swap_final_for_symlink(target: Path, outside: Path) -> None:
    """The checked file becomes a symlink to a same-named file outside the allowed directory."""
    shutil.copy(target, outside / target.name)
    target.unlink()
    os.symlink(outside / target.name, target)


def swap_parent_for_symlink(target: Path, outside: Path) -> None:
    """The adapter directory becomes a symlink to a copy of it outside the allowed directory."""
    copy = shutil.copytree(target.parent, outside / "copy")
    moved = target.parent.with_name("moved")
    target.parent.rename(moved)
    os.symlink(copy, target.parent)


def swap_for_another_file(target: Path, outside: Path) -> None:
    """A different regular file is renamed over the checked one (no symlink at all)."""
    other = target.with_name("other")
    shutil.copy(target, other)
    os.replace(other, target)


SWAPS = [swap_final_for_symlink, swap_parent_for_symlink, swap_for_another_file]


# Where the swap happens: after the path was resolved and checked inside (before the stat that the opened file
# is compared with: only O_NOFOLLOW can catch it), or after that stat, just before the open (the fstat comparison
# catches it too). A regular file renamed over the checked one before the stat is simply the file's new content.
HOOKS = {"after_check": "confined_file", "before_open": "open_no_symlinks"}
CASES = [
    (hook, swap) for hook in HOOKS for swap in SWAPS if not (hook == "after_check" and swap is swap_for_another_file)
]


@pytest.mark.parametrize("hook,swap", CASES, ids=[f"{h}-{s.__name__}" for h, s in CASES])
@pytest.mark.parametrize("file_name", ["adapter_config.json", "adapter_model.safetensors"])
@pytest.mark.parametrize("reader", ["frontend", "engine"])
def test_a_file_swapped_after_the_check_is_not_read(
    clean_adapter, shapes, dirs, monkeypatch, hook, swap, file_name, reader
):
    allowed, outside = dirs
    adapter = shutil.copytree(clean_adapter, allowed / "a")
    original = getattr(adapter_files, HOOKS[hook])
    swapped = []

    def swap_around(*args):
        if hook == "before_open" and args[0].endswith(file_name) and not swapped:
            swap(adapter / file_name, outside)
            swapped.append(hook)
        result = original(*args)
        if hook == "after_check" and args[1].endswith(file_name) and not swapped:
            swap(adapter / file_name, outside)
            swapped.append(hook)
        return result

    read = {
        "frontend": lambda: check_adapter_files("a", str(adapter), [str(allowed)]),
        "engine": lambda: load_peft_adapter("a", str(adapter), shapes, allowed_dirs=[str(allowed)]),
    }[reader]
    read()  # untouched files load
    monkeypatch.setattr(adapter_files, HOOKS[hook], swap_around)
    with pytest.raises(
        LoRAAdapterError,
        match=f"{file_name} (could not be opened as the file that was checked|was replaced while it was being opened)",
    ):
        read()
    assert swapped


def test_a_large_adapter_is_checked_on_threads_with_the_first_bad_tensor_named(monkeypatch):
    import numpy as np

    monkeypatch.setattr(adapter_files, "PARALLEL_CHECK_BYTES", 0)
    tensors = {f"layers.{i}.q_proj.lora_A.weight": np.ones((4, 16), np.float32) for i in range(20)}
    adapter_files.refuse_any_non_finite("big", tensors)  # all finite: passes
    for bad in (3, 17):
        tensors[f"layers.{bad}.q_proj.lora_A.weight"] = np.full((4, 16), np.nan, np.float32)
    with pytest.raises(LoRAAdapterError, match=r"adapter 'big'.*layers\.3\.q_proj\.lora_A\.weight.*NaN or Inf"):
        adapter_files.refuse_any_non_finite("big", tensors)


READS = {  # each way the server reads an adapter's weights: the frontend's check, registration, the first use
    "check": lambda name, path, shapes: check_adapter_files(name, path, None),
    "inspect": inspect_peft_adapter,
    "load": load_peft_adapter,
}


@pytest.mark.parametrize("read", list(READS))
def test_a_file_larger_than_its_header_describes_is_refused_before_its_data_is_read(
    clean_adapter, shapes, tmp_path, read
):
    """A sparse file of 4 GiB (a few KB on disk) whose header names a few KB of tensors: refused from the header and
    the file's size, where reading it whole first took the frontend to 6.4 GB."""
    sparse = shutil.copytree(clean_adapter, tmp_path / "sparse")
    os.truncate(sparse / "adapter_model.safetensors", 4 << 30)
    with pytest.raises(LoRAAdapterError, match=r"adapter 'sparse': adapter_model.safetensors is not a valid") as err:
        READS[read]("sparse", str(sparse), shapes)
    assert "the data is 42" in str(err.value) and "but its tensors take" in str(err.value)


@pytest.mark.parametrize("read", list(READS))
def test_a_header_nested_too_deeply_for_json_is_refused_as_not_json(clean_adapter, shapes, tmp_path, read):
    deep = shutil.copytree(clean_adapter, tmp_path / "deep")
    header = b"[" * 100_000 + b"]" * 100_000
    (deep / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(LoRAAdapterError, match="header is not JSON"):
        READS[read]("deep", str(deep), shapes)
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(LoRAAdapterError, match="adapter_config.json is nested too deeply"):
        inspect_peft_adapter("deep", str(deep), shapes)


def test_the_engine_checks_the_headers_shapes_before_reading_the_tensors(clean_adapter, shapes):
    """read_weights_file hands the shapes to the caller's check first: a refused header leaves the data unread."""
    checked = []

    def refuse(found):
        checked.append(found)
        raise LoRAAdapterError("refused")

    with open(clean_adapter / "adapter_model.safetensors", "rb") as f:
        with pytest.raises(LoRAAdapterError, match="refused"):
            adapter_files.read_weights_file("a", f, refuse)
        header_end = 8 + int.from_bytes((clean_adapter / "adapter_model.safetensors").read_bytes()[:8], "little")
        assert f.tell() == header_end  # nothing past the header was read
    assert checked and all(isinstance(shape, tuple) for shape in checked[0].values())


def test_the_engine_read_parses_the_header_once(clean_adapter, monkeypatch):
    """read_weights_file returns the layout of the header it read, the one its buffer holds: the engine's read of the
    tensors takes it instead of parsing the header again, and gets what a second parse gives."""
    parses = []
    real = safetensors_layout.header_entries
    monkeypatch.setattr(safetensors_layout, "header_entries", lambda *a: parses.append(1) or real(*a))
    with open(clean_adapter / "adapter_model.safetensors", "rb") as f:
        data, layout = adapter_files.read_weights_file("a", f)
    tensors = adapter_files.read_checked_safetensors("a", data, layout)
    assert len(parses) == 1
    parsed_again = adapter_files.read_checked_safetensors("a", data)
    assert len(parses) == 2 and tensors.keys() == parsed_again.keys()
    for key, tensor in tensors.items():
        np.testing.assert_array_equal(tensor, parsed_again[key])


def test_a_path_that_changes_while_it_is_resolved_is_an_adapter_error(dirs, monkeypatch):
    allowed, _ = dirs

    def flipping(path, *args, **kwargs):  # what realpath's readlink raises when a symlink became a file meanwhile
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os.path, "realpath", flipping)
    with pytest.raises(LoRAAdapterError, match="changed while it was resolved"):
        confined_dir("racy", str(allowed / "a"), [str(allowed)])


def test_the_frontend_reads_only_the_lora_halves_values(clean_adapter, shapes, tmp_path):
    """A tensor not named as a LoRA half is refused by its name from the header (registration); the frontend's check of
    values does not read it, however large its header says it is."""
    extra = shutil.copytree(clean_adapter, tmp_path / "extra")
    tensors = load_file(str(extra / "adapter_model.safetensors"))
    save_file({**tensors, "notes.weight": torch.full((4,), float("nan"))}, str(extra / "adapter_model.safetensors"))
    check_adapter_files("extra", str(extra), None)  # its NaN values are never read
    with pytest.raises(
        LoRAAdapterError, match=r"unexpected tensor in adapter_model.safetensors: tensor 'notes.weight'"
    ):
        inspect_peft_adapter("extra", str(extra), shapes)


OUT_OF_FILES_CHILD = """
import os, resource, sys
from sgl_jax_lora.lora.adapter_files import LoRAAdapterError, open_confined
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    with open_confined("a", sys.argv[1], [os.path.dirname(sys.argv[1])]):
        print("opened")
except LoRAAdapterError as e:
    print(e)
"""


def test_a_server_out_of_open_files_says_so_not_that_the_files_changed(tmp_path):
    pytest.importorskip("resource")
    path = tmp_path / "adapter_config.json"
    path.write_text("{}")
    out = subprocess.run(
        [sys.executable, "-c", OUT_OF_FILES_CHILD, str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert "the server has no open file left (EMFILE)" in out and "open-file limit" in out, out
    assert "being changed" not in out
