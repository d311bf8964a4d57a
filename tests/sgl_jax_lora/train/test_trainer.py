"""sgl_jax_lora/train/trainer.py: LoRATrainer's update compiles once; later steps reuse its program.
(Its loss and the adapter it exports are tested end to end in test_train.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.train.trainer import LoRATrainer

# slow: kept from tests/sgl_jax_lora/train/test_train.py, whose tests are all slow
pytestmark = pytest.mark.slow


def test_the_update_compiles_once():
    """The adapter and optimizer state start placed as the update returns them, so later steps reuse the first
    step's program."""
    from sgl_jax_lora.model_executor.compile_counter import CompileCounter

    trainer = LoRATrainer(demo_model_path(), rank=4)
    ids = np.random.default_rng(0).integers(2, 400, (2, 16)).astype(np.int32)
    batch = {"input_ids": ids, "loss_mask": np.ones(ids.shape, np.float32)}
    trainer.step(batch)
    counter = CompileCounter()
    for _ in range(3):
        trainer.step(batch)
    assert counter.count == 0
