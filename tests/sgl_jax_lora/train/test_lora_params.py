"""sgl_jax_lora/train/lora_params.py: init_lora_params follows PEFT's default init (A uniform in +-1/sqrt(in), B zero,
shapes per module and layer), refuses bad ranks and modules; peft_tensors / peft_config / save_peft_adapter give
what PEFT writes, and the adapter loader reads the saved directory back to the same weights and scaling."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from sgl_jax_lora.lora.adapter import load_peft_adapter
from sgl_jax_lora.lora.peft_config import CONFIG_FILE, WEIGHTS_FILE
from sgl_jax_lora.lora.target_shapes import LoRATargetShapes
from sgl_jax_lora.train.lora_params import (
    LoRAParams,
    check_target_modules,
    init_lora_params,
    peft_config,
    peft_tensors,
    save_peft_adapter,
)

# hidden 32, 4 heads of 8, 2 kv heads (k/v out 16), intermediate 48, 3 layers
SHAPES = LoRATargetShapes.from_hf_config(
    dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, num_hidden_layers=3)
)


def test_check_target_modules_orders_known_names_and_refuses_others():
    assert check_target_modules(["down_proj", "q_proj", "v_proj"]) == ("q_proj", "v_proj", "down_proj")
    with pytest.raises(ValueError, match="lm_head"):
        check_target_modules(["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="not supported"):
        check_target_modules([])


def test_init_shapes_bounds_and_zero_b():
    params = init_lora_params(SHAPES, ("k_proj", "down_proj"), rank=4, lora_alpha=8)
    assert set(params.weights) == {"k_proj", "down_proj"}
    assert params.scaling == 2.0 and params.rank == 4 and params.lora_alpha == 8.0
    for module, (in_features, out_features) in (("k_proj", (32, 16)), ("down_proj", (48, 32))):
        a, b = np.asarray(params.weights[module]["A"]), np.asarray(params.weights[module]["B"])
        assert a.shape == (3, 4, in_features) and a.dtype == np.float32
        assert b.shape == (3, out_features, 4) and not b.any()
        bound = 1.0 / np.sqrt(in_features)
        assert np.abs(a).max() <= bound and np.abs(a).max() > 0.5 * bound
    # each module draws from its own key: equal shapes would otherwise get equal weights
    same = init_lora_params(SHAPES, ("q_proj", "o_proj"), rank=4, lora_alpha=8)
    assert not np.array_equal(same.weights["q_proj"]["A"], same.weights["o_proj"]["A"])


def test_init_is_deterministic_per_seed_and_refuses_bad_rank():
    first, again = (init_lora_params(SHAPES, ("q_proj",), 2, 4.0, seed=7) for _ in range(2))
    other = init_lora_params(SHAPES, ("q_proj",), 2, 4.0, seed=8)
    np.testing.assert_array_equal(first.weights["q_proj"]["A"], again.weights["q_proj"]["A"])
    assert not np.array_equal(first.weights["q_proj"]["A"], other.weights["q_proj"]["A"])
    with pytest.raises(ValueError, match="--rank"):
        init_lora_params(SHAPES, ("q_proj",), 0, 4.0)


def test_lora_params_is_a_pytree_of_the_weights_only():
    params = init_lora_params(SHAPES, ("q_proj", "up_proj"), rank=2, lora_alpha=2)
    assert len(jax.tree_util.tree_leaves(params)) == 4
    doubled = jax.tree_util.tree_map(lambda w: w * 2, params)
    assert isinstance(doubled, LoRAParams) and doubled.scaling == params.scaling and doubled.rank == 2


def random_params(rng: np.random.Generator, modules: tuple[str, ...], rank: int, alpha: float) -> LoRAParams:
    weights = {}
    for module in modules:
        in_features, out_features = SHAPES.module_shapes[module]
        weights[module] = {
            "A": rng.standard_normal((SHAPES.num_layers, rank, in_features)).astype(np.float32),
            "B": rng.standard_normal((SHAPES.num_layers, out_features, rank)).astype(np.float32),
        }
    return LoRAParams(weights=weights, scaling=alpha / rank, rank=rank, lora_alpha=alpha)


def test_peft_tensors_names_every_layer_and_module():
    params = random_params(np.random.default_rng(0), ("v_proj", "gate_proj"), rank=2, alpha=4.0)
    tensors = peft_tensors(params)
    assert len(tensors) == 3 * 2 * 2
    key = "base_model.model.model.layers.2.mlp.gate_proj.lora_B.weight"
    np.testing.assert_array_equal(tensors[key], params.weights["gate_proj"]["B"][2])
    key = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"
    np.testing.assert_array_equal(tensors[key], params.weights["v_proj"]["A"][0])
    assert all(t.dtype == np.float32 and t.flags.c_contiguous for t in tensors.values())


def test_peft_config_fields():
    params = random_params(np.random.default_rng(0), ("up_proj", "o_proj"), rank=4, alpha=16.0)
    config = peft_config(params, "/models/base")
    assert config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["target_modules"] == ["o_proj", "up_proj"]
    assert config["base_model_name_or_path"] == "/models/base"
    assert (config["peft_type"], config["use_rslora"], config["bias"]) == ("LORA", False, "none")


def test_saved_adapter_loads_back_with_the_same_weights_and_scaling(tmp_path):
    params = random_params(np.random.default_rng(1), ("q_proj", "down_proj"), rank=4, alpha=8.0)
    out = save_peft_adapter(params, str(tmp_path / "adapter"), "/models/base")
    assert (tmp_path / "adapter" / WEIGHTS_FILE).is_file()
    assert json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())["r"] == 4
    adapter = load_peft_adapter("trained", out, SHAPES)
    assert adapter.scaling == pytest.approx(2.0) and adapter.rank == 4
    assert adapter.target_modules == {"q_proj", "down_proj"}
    for layer in range(SHAPES.num_layers):
        for module in ("q_proj", "down_proj"):
            a, b = adapter.weights[(layer, module)]
            np.testing.assert_array_equal(a, params.weights[module]["A"][layer])
            np.testing.assert_array_equal(b, params.weights[module]["B"][layer])
