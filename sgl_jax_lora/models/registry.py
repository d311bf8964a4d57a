"""Architecture name -> model class. One Llama-family class covers all four: Qwen2 differs only by its
qkv bias and Qwen3 by per-head q/k RMSNorm, both read from the config (configs/model_config.py)."""

from __future__ import annotations

from sgl_jax_lora.configs.model_config import ARCHITECTURE_FLAGS, ModelConfig
from sgl_jax_lora.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type] = {arch: LlamaForCausalLM for arch in ARCHITECTURE_FLAGS}


def model_class_for(cfg: ModelConfig) -> type:
    return MODEL_CLASSES[cfg.architecture]
