"""A small training set for the LoRA training tests (tests/sgl_jax_lora/train/): prompt/completion pairs and one chat,
written as the JSON lines `sgl_jax_lora.train` reads."""

from __future__ import annotations

import json
from pathlib import Path

PAIRS = [
    ("What is the capital of France?", " Paris is the capital of France."),
    ("Tell me a story about a robot.", " Once upon a time there was a small robot."),
    ("Numbers:", " 0 1 2 3 4 5 6 7 8 9."),
    ("def add(a, b):", " return a + b"),
]
CHAT = {
    "messages": [{"role": "user", "content": "Hello, world!"}, {"role": "assistant", "content": "The quick brown fox."}]
}


def write_data_file(path: Path) -> Path:
    """PAIRS then CHAT, one JSON object a line, at `path`."""
    lines = [json.dumps({"prompt": p, "completion": c}) for p, c in PAIRS] + [json.dumps(CHAT)]
    path.write_text("\n".join(lines) + "\n")
    return path
