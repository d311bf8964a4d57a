"""LoRATargetShapes: the base model's LoRA-targetable linears, as the adapter loader needs them; LORA_TARGETS: which
HF modules each packed linear of the model carries.

Where it sits: the lora package's adapter data, below the models (models/llama.py builds its LoRA linears from
LORA_TARGETS) and everything that lays adapters out (lora/memory_pool.py, lora/lora_setup.py).

Flow: the engine reads the base model's HF `config.json` -> `LoRATargetShapes.from_hf_config` ->
`load_peft_adapter(..., target_shapes)` checks every adapter tensor against these shapes before any
weight reaches the host cache or a device slot.

Shapes follow torch's `nn.Linear` convention of the PEFT files: (in_features, out_features).
"""

from __future__ import annotations

import dataclasses

# The projections LoRA may target, in HF names. Packed modules of our model stack them
# (qkv_proj <- q, k, v; gate_up_proj <- gate, up); adapters always use the unpacked names.
LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

# Parent submodule of each projection inside a decoder layer (HF Llama/Mistral/Qwen layout).
MODULE_PARENT: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


# Packed linear of the Llama-family model -> (HF modules it carries, row-parallel?)
LORA_TARGETS: dict[str, tuple[tuple[str, ...], bool]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), False),
    "o_proj": (("o_proj",), True),
    "gate_up_proj": (("gate_proj", "up_proj"), False),
    "down_proj": (("down_proj",), True),
}


@dataclasses.dataclass(frozen=True)
class LoRATargetShapes:
    num_layers: int  # L decoder layers
    module_shapes: dict[str, tuple[int, int]]  # HF module name -> (in_features, out_features)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LoRATargetShapes:
        """Shapes of q/k/v/o/gate/up/down from an HF config dict (Llama-style field names)."""
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]
        missing = [
            k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers") if k not in cfg
        ]
        if missing:
            raise ValueError(f"base model config lacks {missing}; LoRA target shapes need them")
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        inter = int(cfg["intermediate_size"])
        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        shapes = {
            "q_proj": (hidden, q_out),
            "k_proj": (hidden, kv_out),
            "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        return cls(num_layers=int(cfg["num_hidden_layers"]), module_shapes=shapes)

    @staticmethod
    def module_path(layer_index: int, module: str) -> str:
        """Full HF module path, e.g. (3, "q_proj") -> "model.layers.3.self_attn.q_proj"."""
        return f"model.layers.{layer_index}.{MODULE_PARENT[module]}.{module}"

    def all_module_paths(self) -> list[tuple[int, str, str]]:
        """(layer_index, module, full path) for every targetable linear of the base model."""
        return [
            (layer, module, self.module_path(layer, module))
            for layer in range(self.num_layers)
            for module in LORA_TARGET_MODULES
            if module in self.module_shapes
        ]
