"""sgl_jax_lora/lora/target_shapes.py: the (in_features, out_features) of every LoRA-targetable linear, derived by
hand for multi-head, grouped-query and explicit-head_dim (Qwen3-style) configs and a config nested under
`text_config`; a config lacking a field is refused naming it; HF module paths and their order; the packed linears
of LORA_TARGETS carry every targetable module once, o_proj and down_proj row-parallel."""

from __future__ import annotations

import pytest

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.lora.target_shapes import LORA_TARGET_MODULES, LORA_TARGETS, MODULE_PARENT, LoRATargetShapes

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
}


def test_multi_head_attention_shapes():
    shapes = LoRATargetShapes.from_hf_config(BASE)  # head_dim 64 / 8 = 8; kv heads = heads
    assert shapes.num_layers == 3
    assert shapes.module_shapes == {
        "q_proj": (64, 64),
        "k_proj": (64, 64),
        "v_proj": (64, 64),
        "o_proj": (64, 64),
        "gate_proj": (64, 160),
        "up_proj": (64, 160),
        "down_proj": (160, 64),
    }


def test_grouped_query_attention_narrows_k_and_v():
    shapes = LoRATargetShapes.from_hf_config({**BASE, "num_key_value_heads": 2}).module_shapes
    assert shapes["q_proj"] == (64, 64)
    assert shapes["k_proj"] == shapes["v_proj"] == (64, 16)  # 2 kv heads x head_dim 8
    assert shapes["o_proj"] == (64, 64)


def test_an_explicit_head_dim_sets_the_attention_width():
    cfg = {**BASE, "num_key_value_heads": 2, "head_dim": 32}  # 8 x 32 = 256 wide attention on a 64 residual
    shapes = LoRATargetShapes.from_hf_config(cfg).module_shapes
    assert shapes["q_proj"] == (64, 256)
    assert shapes["k_proj"] == shapes["v_proj"] == (64, 64)
    assert shapes["o_proj"] == (256, 64)


def test_null_kv_heads_and_head_dim_fall_back_to_their_defaults():
    shapes = LoRATargetShapes.from_hf_config({**BASE, "num_key_value_heads": None, "head_dim": None})
    assert shapes == LoRATargetShapes.from_hf_config(BASE)


def test_a_multimodal_config_is_read_from_its_text_config():
    nested = {"architectures": ["Something"], "text_config": {**BASE, "num_key_value_heads": 4}}
    shapes = LoRATargetShapes.from_hf_config(nested)
    assert shapes.num_layers == 3
    assert shapes.module_shapes["k_proj"] == (64, 32)


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers"])
def test_a_missing_field_is_named(field: str):
    cfg = {k: v for k, v in BASE.items() if k != field}
    with pytest.raises(ValueError, match=f"lacks \\['{field}'\\]"):
        LoRATargetShapes.from_hf_config(cfg)


def test_shapes_agree_with_the_engines_model_config():
    cfg = {**BASE, "num_key_value_heads": 2, "head_dim": 16, "architectures": ["Qwen3ForCausalLM"]}
    model = ModelConfig.from_dict(cfg)
    shapes = LoRATargetShapes.from_hf_config(cfg).module_shapes
    assert shapes["q_proj"][1] == model.num_heads * model.head_dim
    assert shapes["k_proj"][1] == model.num_kv_heads * model.head_dim
    assert shapes["down_proj"] == (model.intermediate_size, model.hidden_size)


def test_module_paths_follow_the_hf_layout():
    assert LoRATargetShapes.module_path(3, "q_proj") == "model.layers.3.self_attn.q_proj"
    assert LoRATargetShapes.module_path(0, "o_proj") == "model.layers.0.self_attn.o_proj"
    assert LoRATargetShapes.module_path(11, "down_proj") == "model.layers.11.mlp.down_proj"
    assert LoRATargetShapes.module_path(2, "gate_proj") == "model.layers.2.mlp.gate_proj"


def test_all_module_paths_go_layer_by_layer_in_module_order():
    paths = LoRATargetShapes.from_hf_config({**BASE, "num_hidden_layers": 2}).all_module_paths()
    assert len(paths) == 2 * 7
    assert paths[0] == (0, "q_proj", "model.layers.0.self_attn.q_proj")
    assert paths[6] == (0, "down_proj", "model.layers.0.mlp.down_proj")
    assert paths[7] == (1, "q_proj", "model.layers.1.self_attn.q_proj")
    assert [m for _, m, _ in paths[:7]] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_all_module_paths_skip_modules_without_a_shape():
    shapes = LoRATargetShapes(num_layers=2, module_shapes={"v_proj": (8, 4), "up_proj": (8, 16)})
    assert shapes.all_module_paths() == [
        (0, "v_proj", "model.layers.0.self_attn.v_proj"),
        (0, "up_proj", "model.layers.0.mlp.up_proj"),
        (1, "v_proj", "model.layers.1.self_attn.v_proj"),
        (1, "up_proj", "model.layers.1.mlp.up_proj"),
    ]


def test_packed_linears_carry_every_target_once():
    carried = [module for modules, _ in LORA_TARGETS.values() for module in modules]
    assert sorted(carried) == sorted(LORA_TARGET_MODULES)
    assert set(MODULE_PARENT) == set(LORA_TARGET_MODULES)
    assert {name for name, (_, row_parallel) in LORA_TARGETS.items() if row_parallel} == {"o_proj", "down_proj"}
    assert LORA_TARGETS["qkv_proj"][0] == ("q_proj", "k_proj", "v_proj")
    assert LORA_TARGETS["gate_up_proj"][0] == ("gate_proj", "up_proj")
