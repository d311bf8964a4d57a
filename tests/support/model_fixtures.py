"""Test helpers: tiny random HF checkpoints of every supported architecture, with a real tokenizer.

Each directory is what `save_pretrained` writes (config.json + model.safetensors) plus the demo model's
tokenizer files, so the engine can serve it as it is. Nothing is downloaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from sgl_jax_lora.demo_model import demo_model_path

_BASE = dict(
    vocab_size=491,  # the demo tokenizer's size
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=0,
    eos_token_id=1,
)

ARCH_CONFIGS = {
    "llama": (LlamaConfig, dict(tie_word_embeddings=False)),
    "llama3_rope": (
        LlamaConfig,
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
    ),
    # dynamic NTK, served within max_position_embeddings (the 37-token prompts of the parity tests fit its 64)
    "llama_dynamic": (
        LlamaConfig,
        dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=64),
    ),
    "mistral": (MistralConfig, dict(sliding_window=None)),
    # YaRN as Qwen2.5's model card sets it for long contexts (here over a 128-token pretrained context)
    "qwen2_yarn": (
        Qwen2Config,
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    ),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, dict(tie_word_embeddings=False)),
}


def make_hf_model_dir(path: str | Path, arch: str = "llama", seed: int = 0, **overrides: object) -> Path:
    config_cls, arch_overrides = ARCH_CONFIGS[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**_BASE, **arch_overrides, **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    path = Path(path)
    model.save_pretrained(str(path))
    copy_demo_tokenizer(path)
    return path


def copy_demo_tokenizer(path: Path) -> None:
    demo = Path(demo_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, path / name)


def load_hf_model(path: str | Path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
