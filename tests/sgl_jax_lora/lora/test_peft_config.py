"""sgl_jax_lora/lora/peft_config.py: adapter_config.json fields parsed on their own: the adapter's scaling (rslora),
and refused configs naming the field. Which modules a config targets is tested in test_peft_targets.py; loading
whole PEFT adapters against the peft library in test_adapter.py.
"""

from __future__ import annotations

import math

import pytest

from sgl_jax_lora.lora.peft_config import LoRAAdapterError, parse_peft_config


def test_rslora_scales_by_the_square_root_of_the_rank():
    plain = parse_peft_config("a", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
    assert plain.scaling == 2.0
    rslora = parse_peft_config("a", {"r": 16, "lora_alpha": 8, "target_modules": ["q_proj"], "use_rslora": True})
    assert rslora.scaling == 8 / math.sqrt(16)


@pytest.mark.parametrize(
    "raw, message",
    [
        ([1], "not a dict of adapter_config.json fields"),
        ({"lora_alpha": 8, "target_modules": ["q_proj"]}, "has no 'r'"),
        ({"r": 0, "lora_alpha": 8, "target_modules": ["q_proj"]}, "'s r must be a positive integer"),
        ({"r": 4, "lora_alpha": -1, "target_modules": ["q_proj"]}, "lora_alpha must be a non-negative finite number"),
        ({"r": 2**64, "lora_alpha": 8, "target_modules": ["q_proj"]}, "r must be a positive integer up to 2147483647"),
        ({"r": 4, "lora_alpha": 10**400, "target_modules": ["q_proj"]}, "lora_alpha must be a non-negative finite"),
        ({"r": 4, "lora_alpha": float("inf"), "target_modules": ["q_proj"]}, "lora_alpha must be a non-negative"),
        (
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "layers_to_transform": 2**70},
            "layers_to_transform must be a layer index",
        ),
        ({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "IA3"}, "peft_type is not LORA"),
        ({"r": 4, "lora_alpha": 8, "target_modules": ["lm_head"]}, r"embedding/output layer \(lm_head\)"),
        ({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "exclude_modules": "(("}, "exclude_modules has a"),
        (
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": "(("},
            "layers_pattern has a string that is not a valid regular expression",
        ),
        ({"r": 4, "lora_alpha": 8, "target_modules": "q" * 5000}, "regular expression of 5000 characters"),
        ({"r": 4, "lora_alpha": 8, "target_modules": ["conv"]}, "names module .conv., which LoRA cannot target"),
        ({"r": 4, "lora_alpha": 8, "target_modules": "("}, "not a valid regular expression"),
        (
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "rank_pattern": {"q_proj": 0}},
            r"rank_pattern must be a dict of positive integers \(ranks\)",
        ),
        (
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "rank_pattern": {"q_proj": 2**64}},
            "rank_pattern must be a dict of positive integers",
        ),
        (
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "alpha_pattern": {"q_proj": -(10**400)}},
            "alpha_pattern must be a dict of non-negative numbers",
        ),
        (
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "alpha_pattern": {"[": 1}},
            "alpha_pattern has a string",
        ),
    ],
)
def test_a_config_that_cannot_be_served_is_refused_naming_the_problem(raw, message):
    with pytest.raises(LoRAAdapterError, match=message):
        parse_peft_config("a", raw)
