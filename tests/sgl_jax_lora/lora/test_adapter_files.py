"""Adapter files as untrusted input (lora/adapter_files.py and the loader): non-finite tensors are refused, every
file an adapter opens must resolve inside the allowed directories, and errors never quote a file's contents.

Adapters are real PEFT directories (tests/support/peft_fixtures.py); symlinks are real symlinks.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from tests.support.peft_fixtures import make_tiny_llama_dir, poison_adapter, write_peft_adapter

from sgl_jax_lora.lora.adapter import inspect_peft_adapter, load_peft_adapter
from sgl_jax_lora.lora.adapter_files import check_adapter_files, confined_dir
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.lora.target_shapes import LoRATargetShapes

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
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["f32", "bf16"])
def test_non_finite_tensor_is_refused_naming_adapter_and_tensor(clean_adapter, shapes, tmp_path, value, dtype):
    bad = shutil.copytree(clean_adapter, tmp_path / "bad")
    key = poison_adapter(bad, value, dtype)
    for check in (lambda: load_peft_adapter("poisoned", str(bad), shapes),
                  lambda: check_adapter_files("poisoned", str(bad), None)):
        with pytest.raises(LoRAAdapterError) as err:
            check()
        message = str(err.value)
        assert "adapter 'poisoned'" in message and key in message and "NaN or Inf" in message
    # the clean original still loads, and header-only registration cannot see values (the weights' read does)
    assert load_peft_adapter("clean", str(clean_adapter), shapes).rank == 4
    assert inspect_peft_adapter("poisoned", str(bad), shapes).rank == 4


def test_symlinked_weights_outside_the_allowed_dirs_are_refused(clean_adapter, shapes, dirs):
    allowed, outside = dirs
    shutil.copy(clean_adapter / "adapter_model.safetensors", outside / "adapter_model.safetensors")
    adapter = allowed / "a"
    adapter.mkdir()
    shutil.copy(clean_adapter / "adapter_config.json", adapter / "adapter_config.json")
    os.symlink(outside / "adapter_model.safetensors", adapter / "adapter_model.safetensors")
    assert confined_dir("a", str(adapter), [str(allowed)]) == os.path.realpath(adapter)  # the directory itself is fine
    for check in (lambda: check_adapter_files("a", str(adapter), [str(allowed)]),
                  lambda: inspect_peft_adapter("a", str(adapter), shapes, allowed_dirs=[str(allowed)]),
                  lambda: load_peft_adapter("a", str(adapter), shapes, allowed_dirs=[str(allowed)])):
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
    for check in (lambda: check_adapter_files("a", str(adapter), [str(allowed)]),
                  lambda: inspect_peft_adapter("a", str(adapter), shapes, allowed_dirs=[str(allowed)])):
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


def test_config_values_are_cut_in_errors(clean_adapter, shapes, tmp_path):
    adapter = shutil.copytree(clean_adapter, tmp_path / "long")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "X" * 100_000}))
    with pytest.raises(LoRAAdapterError) as err:
        inspect_peft_adapter("n" * 10_000, str(adapter), shapes)
    assert "is not LoRA" in str(err.value) and len(str(err.value)) < 400
    (adapter / "adapter_config.json").write_text('{"peft_type": "' + SECRET)  # truncated JSON
    with pytest.raises(LoRAAdapterError, match=r"not valid JSON \(line 1") as err:
        inspect_peft_adapter("a", str(adapter), shapes)
    assert SECRET not in str(err.value)
