"""managers/adapter_commands.py on an engine that serves no LoRA: every command refuses, naming the flags that turn
LoRA on (the frontend refuses such calls first; these are the engine's own checks). The commands on an engine with
adapters are tested through the engine: tests/sgl_jax_lora/test_engine_lora_from_memory.py and
tests/sgl_jax_lora/lora/test_adapter_isolation.py."""

from __future__ import annotations

import pytest

from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.managers import adapter_commands


@pytest.mark.parametrize(
    "command",
    [
        lambda: adapter_commands.load_from_dir(None, LoRARef(lora_name="a", lora_path="/a")),
        lambda: adapter_commands.load_from_memory(None, None, LoRARef(lora_name="a", lora_path=""), [], None),
        lambda: adapter_commands.unload(None, None, "a"),
    ],
    ids=["from_dir", "from_memory", "unload"],
)
def test_without_lora_every_command_names_the_flags_that_enable_it(command):
    with pytest.raises(ValueError, match="LoRA is not enabled; restart with --enable-lora or --lora-paths"):
        command()
