"""LoRA compute backends (`--lora-backend einsum|bgmv|sgmv|pallas|auto`); see docs/lora_backends.md."""

from sgl_jax_lora.lora.backend.base import BACKEND_NAMES, LoRABackend, LoRAMeta, make_lora_backend

__all__ = ["BACKEND_NAMES", "LoRABackend", "LoRAMeta", "make_lora_backend"]
