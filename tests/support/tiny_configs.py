"""TINY_LLAMA_CONFIG: the config.json of a tiny Llama (2 layers, GQA 4/2) for tests that build a model from a config
alone, with dummy or orbax weights and no HF checkpoint (tests/support/model_fixtures.py writes real checkpoints)."""

from __future__ import annotations

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
