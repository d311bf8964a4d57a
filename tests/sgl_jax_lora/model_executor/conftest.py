"""Fixtures of the model_executor tests: `model_config`, the kernel-shaped Llama (tests/support/model_export.py) that
the TPU export, TPU compile and CUDA lowering tests build their forward programs from."""

from __future__ import annotations

import pytest

from sgl_jax_lora.configs.model_config import ModelConfig
from tests.support.model_export import kernel_shaped_config


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> ModelConfig:
    return kernel_shaped_config(tmp_path_factory.mktemp("kernel-shaped-model"))
