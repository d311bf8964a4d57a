"""sgl_jax_lora/lora/lora_ref.py: each LoRARef gets its own id, and a ref cannot be changed once made."""

from __future__ import annotations

import pytest

from sgl_jax_lora.lora.lora_ref import LoRARef


def test_lora_ref_ids_are_unique_and_frozen() -> None:
    first, second = LoRARef("a", "/p"), LoRARef("a", "/p")
    assert first.lora_id != second.lora_id and len(first.lora_id) == 32
    with pytest.raises(AttributeError):
        first.lora_name = "b"  # type: ignore[misc]
