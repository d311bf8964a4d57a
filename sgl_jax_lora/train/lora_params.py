"""LoRAParams: the trainable adapter (A/B per HF module, stacked over layers) and its PEFT form.

Flow: LoRATrainer creates them with `init_lora_params` (PEFT's default init: A uniform in +-1/sqrt(in), B zero, so
training starts from the base model) -> optax updates them -> `peft_tensors` / `peft_config` give what PEFT's
save_pretrained writes (tensor names "base_model.model.model.layers.{l}.{self_attn|mlp}.{module}.lora_{A|B}.weight",
adapter_config.json fields) -> `save_peft_adapter` writes the directory, or Engine.update_lora_adapter takes the
tensors straight from memory.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from sgl_jax_lora.lora.peft_config import CONFIG_FILE, WEIGHTS_FILE
from sgl_jax_lora.lora.target_shapes import LORA_TARGET_MODULES, LoRATargetShapes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAParams:
    # module -> {"A": [L, R, in] f32, "B": [L, out, R] f32}; modules the adapter does not target are absent
    weights: dict[str, dict[str, jax.Array]]
    scaling: float = dataclasses.field(metadata=dict(static=True))  # lora_alpha / r
    rank: int = dataclasses.field(metadata=dict(static=True))  # R
    lora_alpha: float = dataclasses.field(metadata=dict(static=True))


def check_target_modules(modules: list[str]) -> tuple[str, ...]:
    unknown = sorted(set(modules) - set(LORA_TARGET_MODULES))
    if unknown or not modules:
        raise ValueError(
            f"--target-modules {unknown or modules} not supported; choose among {', '.join(LORA_TARGET_MODULES)}"
        )
    return tuple(m for m in LORA_TARGET_MODULES if m in modules)


def init_lora_params(
    target_shapes: LoRATargetShapes, modules: tuple[str, ...], rank: int, lora_alpha: float, seed: int = 0
) -> LoRAParams:
    """A ~ U(+-1/sqrt(in)) (PEFT's kaiming-uniform default), B = 0: the adapter starts as the identity."""
    if rank <= 0:
        raise ValueError(f"--rank must be a positive integer, got {rank}")
    key = jax.random.key(seed)
    weights = {}
    for i, module in enumerate(check_target_modules(list(modules))):
        in_features, out_features = target_shapes.module_shapes[module]
        bound = 1.0 / np.sqrt(in_features)
        shape = (target_shapes.num_layers, rank, in_features)
        a = jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32, -bound, bound)
        weights[module] = {"A": a, "B": jnp.zeros((target_shapes.num_layers, out_features, rank), jnp.float32)}
    return LoRAParams(weights=weights, scaling=lora_alpha / rank, rank=rank, lora_alpha=float(lora_alpha))


def peft_tensors(params: LoRAParams) -> dict[str, np.ndarray]:
    """PEFT tensor name -> float32 numpy array (what adapter_model.safetensors holds)."""
    tensors = {}
    for module, pair in params.weights.items():
        a, b = np.asarray(pair["A"], np.float32), np.asarray(pair["B"], np.float32)
        for layer in range(a.shape[0]):
            path = "base_model.model." + LoRATargetShapes.module_path(layer, module)
            tensors[f"{path}.lora_A.weight"] = np.ascontiguousarray(a[layer])
            tensors[f"{path}.lora_B.weight"] = np.ascontiguousarray(b[layer])
    return tensors


def peft_config(params: LoRAParams, base_model_path: str) -> dict:
    """adapter_config.json fields of a plain LoRA adapter, as PEFT's LoraConfig writes them."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path,
        "r": params.rank,
        "lora_alpha": params.lora_alpha,
        "target_modules": sorted(params.weights),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def save_peft_adapter(params: LoRAParams, out_dir: str, base_model_path: str) -> str:
    """Write adapter_config.json + adapter_model.safetensors (loadable by PeftModel.from_pretrained and our server)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(peft_config(params, base_model_path), f, indent=2)
    save_file(peft_tensors(params), os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir
