"""sgl_jax_lora/models/registry.py: every supported architecture maps to the one Llama-family class, a ModelConfig
of each architecture finds it, and an architecture outside the table is refused."""

from __future__ import annotations

import dataclasses

import pytest

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.models.llama import LlamaForCausalLM
from sgl_jax_lora.models.registry import MODEL_CLASSES, model_class_for

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def config(architecture: str) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": [architecture],
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        }
    )


def test_the_table_covers_exactly_the_supported_architectures():
    assert sorted(MODEL_CLASSES) == sorted(ARCHITECTURES)
    assert set(MODEL_CLASSES.values()) == {LlamaForCausalLM}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_each_architecture_finds_the_llama_family_class(architecture: str):
    cfg = config(architecture)
    assert cfg.architecture == architecture
    assert model_class_for(cfg) is LlamaForCausalLM


def test_the_architectures_differ_only_in_config_flags():
    flags = {a: (config(a).qkv_bias, config(a).qk_norm) for a in ARCHITECTURES}
    assert flags == {
        "LlamaForCausalLM": (False, False),
        "MistralForCausalLM": (False, False),
        "Qwen2ForCausalLM": (True, False),
        "Qwen3ForCausalLM": (False, True),
    }


def test_an_architecture_outside_the_table_is_refused():
    cfg = dataclasses.replace(config("LlamaForCausalLM"), architecture="GPT2LMHeadModel")
    with pytest.raises(KeyError, match="GPT2LMHeadModel"):
        model_class_for(cfg)
