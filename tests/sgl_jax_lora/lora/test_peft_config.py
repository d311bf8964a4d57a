"""sgl_jax_lora/lora/peft_config.py: adapter_config.json fields parsed on their own: which module paths an adapter
targets (short names, a regex, exclude_modules, layers_to_transform), the per-module rank and scaling
(rank_pattern, alpha_pattern, rslora), and refused configs naming the field. Loading whole PEFT adapters against
the peft library is tested in test_adapter.py.
"""

from __future__ import annotations

import math

import pytest

from sgl_jax_lora.lora.peft_config import LoRAAdapterError, parse_peft_config

Q = "base_model.model.model.layers.{}.self_attn.q_proj"
V = "base_model.model.model.layers.{}.self_attn.v_proj"


def test_short_names_exclusions_and_layers_select_the_modules():
    config = parse_peft_config(
        "a", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1, 3]}
    )
    assert config.targets(Q.format(1)) and config.targets(V.format(3))
    assert not config.targets(Q.format(0)) and not config.targets(Q.format(2))
    assert not config.targets("base_model.model.model.layers.1.mlp.down_proj")
    excluded = parse_peft_config(
        "a", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "exclude_modules": ["v_proj"]}
    )
    assert excluded.targets(Q.format(0)) and not excluded.targets(V.format(0))


def test_a_regex_target_must_match_the_whole_path():
    config = parse_peft_config("a", {"r": 4, "lora_alpha": 8, "target_modules": r".*layers\.0\.self_attn\.q_proj"})
    assert config.targets(Q.format(0)) and not config.targets(Q.format(10)) and not config.targets(V.format(0))


def test_rank_and_alpha_patterns_and_rslora_set_each_modules_scaling():
    config = parse_peft_config(
        "a",
        {
            "r": 8,
            "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"],
            "rank_pattern": {"v_proj": 2},
            "alpha_pattern": {"layers.1.self_attn.q_proj": 4},
        },
    )
    assert config.scaling == 2.0
    assert (config.rank_for(Q.format(0)), config.scaling_for(Q.format(0))) == (8, 2.0)
    assert (config.rank_for(V.format(0)), config.scaling_for(V.format(0))) == (2, 8.0)
    assert config.scaling_for(Q.format(1)) == 0.5 and config.scaling_for(Q.format(11)) == 2.0  # 11 is not 1
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
