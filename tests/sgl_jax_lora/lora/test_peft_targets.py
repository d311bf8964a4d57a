"""sgl_jax_lora/lora/peft_targets.py: PEFT's rules for which module paths an adapter config targets (short names, a
regex, exclude_modules, layers_to_transform) and each module's rank and alpha (rank_pattern, alpha_pattern), over a
parsed config's pattern fields. Whole PEFT adapters against the peft library: test_adapter.py.
"""

from __future__ import annotations

from sgl_jax_lora.lora.peft_config import parse_peft_config, scaling_of
from sgl_jax_lora.lora.peft_targets import rank_and_alpha, targets


def fields(raw: dict) -> dict:
    return parse_peft_config("a", raw).pattern_fields()


def module_scaling(config_fields: dict, path: str) -> float:
    rank, alpha = rank_and_alpha(config_fields, path)
    return scaling_of(alpha, rank, use_rslora=False)


Q = "model.layers.{}.self_attn.q_proj"  # the base model's own paths, as module_settings matches them
V = "model.layers.{}.self_attn.v_proj"


def test_short_names_exclusions_and_layers_select_the_modules():
    config = fields({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1, 3]})
    assert targets(config, Q.format(1)) and targets(config, V.format(3))
    assert not targets(config, Q.format(0)) and not targets(config, Q.format(2))
    assert not targets(config, "model.layers.1.mlp.down_proj")
    excluded = fields({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "exclude_modules": ["v_proj"]})
    assert targets(excluded, Q.format(0)) and not targets(excluded, V.format(0))


def test_a_regex_target_must_match_the_whole_path():
    config = fields({"r": 4, "lora_alpha": 8, "target_modules": r".*layers\.0\.self_attn\.q_proj"})
    assert targets(config, Q.format(0)) and not targets(config, Q.format(10)) and not targets(config, V.format(0))


def test_rank_and_alpha_patterns_set_each_modules_scaling():
    config = fields(
        {
            "r": 8,
            "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"],
            "rank_pattern": {"v_proj": 2},
            "alpha_pattern": {"layers.1.self_attn.q_proj": 4},
        },
    )
    assert (rank_and_alpha(config, Q.format(0))[0], module_scaling(config, Q.format(0))) == (8, 2.0)
    assert (rank_and_alpha(config, V.format(0))[0], module_scaling(config, V.format(0))) == (2, 8.0)
    assert module_scaling(config, Q.format(1)) == 0.5 and module_scaling(config, Q.format(11)) == 2.0  # 11 is not 1
