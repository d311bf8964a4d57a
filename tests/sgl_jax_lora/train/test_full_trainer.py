"""FullTrainer: full-parameter optax steps change every weight, and `save` writes them so that HF transformers and
our loader read back exactly the trained model (the same logits as the trainer's own forward)."""

from __future__ import annotations

import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from sgl_jax_lora.demo_model import MODEL_FILES, demo_model_path
from sgl_jax_lora.train.forward import forward_logits
from sgl_jax_lora.train.full_trainer import NO_ADAPTER, FullTrainer
from tests.support.model_fixtures import load_hf_model


@pytest.mark.slow
def test_trained_weights_saved_and_reloaded_give_the_trainers_logits(tmp_path):
    for name in MODEL_FILES:
        shutil.copy(f"{demo_model_path()}/{name}", tmp_path / name)
    trainer = FullTrainer(str(tmp_path), optax.adam(1e-2))
    ids = np.random.default_rng(0).integers(2, 491, size=(2, 16)).astype(np.int32)
    before = trainer.hf_tensors()
    losses = [trainer.step({"input_ids": ids, "loss_mask": np.ones(ids.shape, np.float32)}) for _ in range(3)]
    assert losses[-1] < losses[0]
    after = trainer.hf_tensors()
    assert all(not np.array_equal(before[name], after[name]) for name in before if not name.endswith("norm.weight"))
    trained = np.asarray(forward_logits(trainer.graphdef, trainer.state, NO_ADAPTER, jnp.asarray(ids)))
    trainer.save(str(tmp_path))
    reloaded = FullTrainer(str(tmp_path), optax.adam(1e-2))
    ours = np.asarray(forward_logits(reloaded.graphdef, reloaded.state, NO_ADAPTER, jnp.asarray(ids)))
    np.testing.assert_allclose(ours, trained, atol=1e-5)
    with torch.no_grad():
        hf = load_hf_model(tmp_path)(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(hf, trained, atol=1e-4)
