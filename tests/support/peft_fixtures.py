"""Test helpers: tiny HF Llama checkpoints and real PEFT adapters written by the `peft` library.

Used by the adapter-loader tests and by engine parity tests (our engine vs HF transformers + PEFT).
Everything is built locally on CPU in float32; nothing is downloaded.

    base_dir = make_tiny_llama_dir(tmp_path / "base")
    adapter_dir = write_peft_adapter(base_dir, tmp_path / "a0", seed=1, r=8, target_modules="all-linear")
    peft_model = load_peft_model(base_dir, adapter_dir)   # reference side for parity checks
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

TINY_LLAMA_CONFIG: dict = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

_MODULE_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)$")


def make_tiny_llama_dir(path: str | Path, seed: int = 0, **config_overrides: object) -> Path:
    """Write a random tiny Llama (config.json + model.safetensors, fp32) to `path`; return the path."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA_CONFIG, **config_overrides})
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(path))
    return Path(path)


def load_base_model(base_model_dir: str | Path) -> PreTrainedModel:
    """The checkpoint's own architecture (config.json's), so that a Mistral keeps its sliding window."""
    return AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32).eval()


def write_peft_adapter(
    base_model_dir: str | Path,
    out_dir: str | Path,
    seed: int,
    *,
    safe_serialization: bool = True,
    b_std: float = 0.05,
    resize_vocab_to: int | None = None,
    **lora_config_kwargs: object,
) -> Path:
    """Save a PEFT LoRA adapter with random non-zero A and B (`peft` save_pretrained); return its dir.

    `lora_config_kwargs` go to `peft.LoraConfig` (defaults: r=8, lora_alpha=16, q_proj+v_proj).
    `resize_vocab_to` grows the embeddings first, which makes PEFT save embed/lm_head weights.
    """
    lora_config_kwargs.setdefault("r", 8)
    lora_config_kwargs.setdefault("lora_alpha", 16)
    lora_config_kwargs.setdefault("target_modules", ["q_proj", "v_proj"])
    model = load_base_model(base_model_dir)
    if resize_vocab_to is not None:
        model.resize_token_embeddings(resize_vocab_to)
    peft_model = get_peft_model(model, LoraConfig(**lora_config_kwargs))
    randomize_lora_weights(peft_model, seed, b_std)
    peft_model.save_pretrained(str(out_dir), safe_serialization=safe_serialization)
    return Path(out_dir)


def randomize_lora_weights(peft_model: PeftModel, seed: int, b_std: float = 0.05) -> None:
    """Replace PEFT's init (B = 0) with random A ~ U(+-1/sqrt(in)) and B ~ N(0, b_std)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_embedding_A" in name:
                bound = 1.0 / np.sqrt(param.shape[-1])
                param.copy_((torch.rand(param.shape, generator=generator) * 2 - 1) * bound)
            elif "lora_B" in name or "lora_embedding_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)


def load_peft_model(base_model_dir: str | Path, adapter_dir: str | Path) -> PeftModel:
    """HF base model + the adapter, loaded the way users load it (PeftModel.from_pretrained), fp32, eval."""
    return PeftModel.from_pretrained(load_base_model(base_model_dir), str(adapter_dir)).eval()


def peft_module_deltas(peft_model: PeftModel, seed: int = 0, num_tokens: int = 5) -> dict:
    """(layer, module) -> (x [T, in], PEFT's delta lora_B(lora_A(x)) * scaling [T, out]) as float64 numpy.

    Only modules that carry an active LoRA adapter appear.
    """
    generator = torch.Generator().manual_seed(seed)
    deltas = {}
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if not isinstance(module, LoraLayer) or not module.active_adapters:
                continue
            adapter_name = module.active_adapters[0]
            if adapter_name not in module.lora_A:
                continue
            match = _MODULE_NAME.search(name)
            assert match is not None, f"unexpected LoRA module {name}"
            lora_a, lora_b = module.lora_A[adapter_name], module.lora_B[adapter_name]
            x = torch.randn(num_tokens, lora_a.in_features, generator=generator)
            delta = lora_b(lora_a(x)) * module.scaling[adapter_name]
            deltas[(int(match[1]), match[2])] = (x.double().numpy(), delta.double().numpy())
    return deltas


def poison_adapter(
    adapter_dir: str | Path, value: float = float("nan"), dtype: torch.dtype | None = None, kind: str = "lora_B"
) -> str:
    """Write `value` (NaN, Inf) into one element of the adapter's first `kind` (lora_A or lora_B) tensor, as a
    broken training run would leave it; optionally re-save every tensor as `dtype`. Returns the tensor's name."""
    from safetensors.torch import load_file, save_file

    path = Path(adapter_dir) / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = sorted(k for k in tensors if kind in k)[0]
    tensors[key][0, 0] = value
    if dtype is not None:
        tensors = {k: t.to(dtype) for k, t in tensors.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return key
