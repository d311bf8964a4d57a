"""PEFT tensor names -> the base model's modules: which module and half (lora_A, lora_B) each tensor of an
adapter's weights belongs to, refusing what PEFT would not load into the base model or what this server does not
serve (embeddings, DoRA, biases, fully trained modules).

Flow: adapter.py's validation -> `group_lora_pairs(name, tensors)` (names -> module path -> both halves) ->
`locate(name, module_path, target_shapes)` (-> layer index and module, the path the base model's own).
"""

from __future__ import annotations

import re

import numpy as np

from sgl_jax_lora.lora.adapter_files import LORA_TENSOR_NAME, tensor_label
from sgl_jax_lora.lora.peft_config import EMBEDDING_MODULES, WEIGHTS_FILE, LoRAAdapterError, adapter_error
from sgl_jax_lora.lora.target_shapes import LORA_TARGET_MODULES, LoRATargetShapes

# "model.layers.3.self_attn.q_proj" -> layer 3, module q_proj (then the whole path must be the base model's own).
_LAYER_MODULE = re.compile(r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.+\.)?(?P<module>[^.]+)$")

# Tensor name fragments that mark unsupported adapter forms: (fragment, problem, fix).
_REFUSED_TENSORS: tuple[tuple[str, str, str], ...] = (
    ("lora_embedding_", "has LoRA tensors on the embedding layer", "retrain without embed_tokens in target_modules"),
    ("lora_magnitude_vector", "is a DoRA adapter (lora_magnitude_vector)", "retrain with use_dora=false"),
    ("modules_to_save", "saves fully trained modules (modules_to_save)", "retrain without modules_to_save"),
    ("trainable_tokens", "adds or retrains token embeddings", "serve a base model that contains those tokens"),
    ("token_adapter", "adds or retrains token embeddings", "serve a base model that contains those tokens"),
)


def group_lora_pairs(name: str, tensors: dict[str, np.ndarray]) -> dict[str, dict[str, tuple[str, np.ndarray]]]:
    """module path -> {"lora_A": (tensor name, tensor), "lora_B": ...}; refuses tensors of unsupported forms,
    half-present pairs and two tensors for one half (a name with and without PEFT's `base_model.model.` prefix)."""
    halves: dict[str, dict[str, tuple[str, np.ndarray]]] = {}
    tags: set[str] = set()
    for key, tensor in tensors.items():
        match = LORA_TENSOR_NAME.match(key)
        if match is None:
            raise _unexpected_tensor_error(name, key)
        if match["tag"]:
            tags.add(match["tag"])
        half = halves.setdefault(match["path"], {})
        if match["kind"] in half:
            raise adapter_error(
                name,
                f"two tensors are the {match['kind']} of {tensor_label(match['path'], 'module')}: "
                f"{tensor_label(half[match['kind']][0])} and {tensor_label(key)}",
                "keep one tensor per module and half, as peft's save_pretrained writes them",
            )
        half[match["kind"]] = (key, tensor)
    if len(tags) > 1:
        raise adapter_error(
            name,
            f"{WEIGHTS_FILE} holds {len(tags)} adapters (tensor names carry {len(tags)} different adapter tags)",
            "save each adapter into its own directory",
        )
    for module_path, half in halves.items():
        if set(half) != {"lora_A", "lora_B"}:
            present = next(iter(half))
            missing = "lora_B" if present == "lora_A" else "lora_A"
            raise adapter_error(
                name, f"{tensor_label(module_path, 'module')} has {present} but no {missing}", "re-save the adapter"
            )
    return halves


def _unexpected_tensor_error(name: str, key: str) -> LoRAAdapterError:
    for fragment, problem, fix in _REFUSED_TENSORS:
        if fragment in key:
            return adapter_error(name, problem, fix)
    if any(key.endswith(f"{m}.weight") for m in EMBEDDING_MODULES):
        return adapter_error(
            name,
            "saves embedding/output weights: the adapter adds tokens or resized the vocabulary",
            "serve a base model that contains those tokens",
        )
    if key.endswith(".bias"):
        return adapter_error(
            name,
            f"has a bias tensor, {tensor_label(key)} (bias/lora_bias training)",
            "retrain with bias='none' and lora_bias=false",
        )
    return adapter_error(
        name,
        f"unexpected tensor in {WEIGHTS_FILE}: {tensor_label(key)}",
        "serve a plain LoRA adapter saved by peft's save_pretrained",
    )


def locate(name: str, module_path: str, target_shapes: LoRATargetShapes) -> tuple[int, str]:
    """(layer_index, module) of a tensor's module path, validated against the base model."""
    match = _LAYER_MODULE.match(module_path)
    short = module_path.rsplit(".", 1)[-1]
    if short in EMBEDDING_MODULES:
        raise adapter_error(
            name,
            f"targets the embedding/output layer ({tensor_label(module_path, 'module')}), which is not supported",
            "retrain without embed_tokens/lm_head in target_modules",
        )
    if match is None or match["module"] not in LORA_TARGET_MODULES:
        raise adapter_error(
            name,
            f"LoRA tensors for an unsupported {tensor_label(module_path, 'module')}",
            f"LoRA can target only: {', '.join(LORA_TARGET_MODULES)}",
        )
    layer_index, module = int(match["layer"]), match["module"]
    if module_path != target_shapes.module_path(layer_index, module):  # another model's layout, or a mangled name
        raise adapter_error(
            name,
            f"LoRA tensors of {tensor_label(module_path, 'module')}, which is not a module path of the base model",
            f"PEFT names them by the model's own paths, like {target_shapes.module_path(0, 'q_proj')!r} (after "
            "'base_model.model.'); use an adapter trained for this base model",
        )
    if layer_index >= target_shapes.num_layers:
        raise adapter_error(
            name,
            f"{tensor_label(module_path, 'module')} is in layer {layer_index}, but the base model has "
            f"{target_shapes.num_layers} layers",
            "use an adapter trained for this base model",
        )
    if module not in target_shapes.module_shapes:
        raise adapter_error(
            name,
            f"the base model has no {module}",
            f"LoRA on this model can target only: {', '.join(target_shapes.module_shapes)}",
        )
    return layer_index, module
