"""sgl_jax_lora/train/trainer.py: LoRATrainer's update compiles once; later steps reuse its program; bad arguments and
batches are refused, and a step that would make the adapter non-finite leaves it as it was.
(Its loss and the adapter it exports are tested end to end in test_train.py.)
"""

from __future__ import annotations

import numpy as np
import optax
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


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=2.5), "rank must be a positive integer, got 2.5"),
        (dict(rank="8"), "rank must be a positive integer, got '8'"),
        (dict(lora_alpha=float("nan")), "lora_alpha must be finite and >= 0, got nan"),
        (dict(dtype="int8"), r"dtype must be one of \('float32', 'bfloat16'\)"),
    ],
)
def test_bad_settings_are_refused_by_their_python_names(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRATrainer(demo_model_path(), **kwargs)


def test_a_step_that_would_make_the_adapter_non_finite_leaves_it_as_it_was():
    trainer = LoRATrainer(demo_model_path(), rank=4, target_modules="q_proj", optimizer=optax.adamw(float("nan")))
    assert list(trainer.lora.weights) == ["q_proj"]  # one module named by a string, not its characters
    ids = np.random.default_rng(0).integers(2, 400, (2, 16)).astype(np.int32)
    before = {name: np.asarray(w["A"]) for name, w in trainer.lora.weights.items()}
    with pytest.raises(ValueError, match=r"the update \(or the optimizer's state\) held NaN or Inf"):
        trainer.step({"input_ids": ids, "loss_mask": np.ones(ids.shape, np.float32)})
    for name, weights in trainer.lora.weights.items():
        np.testing.assert_array_equal(np.asarray(weights["A"]), before[name])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        trainer.step({"input_ids": ids + trainer.vocab_size, "loss_mask": np.ones(ids.shape, np.float32)})
