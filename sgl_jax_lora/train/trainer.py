"""LoRATrainer: optax updates of a LoRA adapter over the frozen base weights of the serving model.

Flow: LoRATrainer(model_path, ...) loads the base model as the engine does (models/weight_loader.py, no LoRA
buffers, one device) and initial LoRAParams -> `step(batch)` runs one jitted optax update: the loss is a function
of the per-token log-probabilities of the training forward (forward.py), gradients flow to the LoRA A/B only ->
`lora` holds the current adapter (save it with lora_params.save_peft_adapter, or push it to a running engine with
Engine.update_lora_adapter(name, peft_tensors(trainer.lora))).

Losses take (token_logprobs [B, S-1], batch) -> scalar: `sft_loss` (mean negative log-likelihood of completion
tokens) for fine-tuning; scripts/rl_lora.py passes a policy-gradient loss.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.lora.target_shapes import LoRATargetShapes
from sgl_jax_lora.models.weight_loader import load_model_state
from sgl_jax_lora.train.forward import token_logprobs
from sgl_jax_lora.train.lora_params import LoRAParams, init_lora_params
from sgl_jax_lora.train.step_guard import checked_batch, guarded_update, raise_if_refused

Loss = Callable[[jax.Array, dict], jax.Array]


def sft_loss(logprobs: jax.Array, batch: dict) -> jax.Array:
    """Mean negative log-likelihood over completion tokens. batch["loss_mask"] [B, S]: 1 on completion tokens."""
    mask = batch["loss_mask"][:, 1:]
    return -(logprobs * mask).sum() / jnp.maximum(mask.sum(), 1.0)


class LoRATrainer:
    def __init__(
        self,
        model_path: str,
        rank: int = 8,
        lora_alpha: float = 16.0,
        target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        optimizer: optax.GradientTransformation | None = None,
        loss: Loss = sft_loss,
        dtype: str = "float32",
        seed: int = 0,
        load_format: str = "auto",
    ):
        """load_format "dummy": random base weights of the config's shapes (benchmarks), as the engine's flag."""
        if isinstance(target_modules, str):
            target_modules = (target_modules,)
        _check_settings(rank, lora_alpha, dtype)
        self.model_path = model_path
        cfg = ModelConfig.from_model_path(model_path)
        self.vocab_size = cfg.vocab_size
        with open(os.path.join(model_path, "config.json")) as f:
            self.target_shapes = LoRATargetShapes.from_hf_config(json.load(f))
        mesh = make_mesh(1)
        self.graphdef, self.base_state = load_model_state(
            cfg, 1, 1, jnp.dtype(dtype), mesh, lora=None, load_format=load_format
        )
        self.optimizer = optimizer if optimizer is not None else optax.adamw(1e-3, weight_decay=0.0)
        lora = init_lora_params(self.target_shapes, target_modules, rank, lora_alpha, seed)
        # placed as the update returns them, so that the second step finds the first step's program
        replicated = NamedSharding(mesh, PartitionSpec())
        self.lora: LoRAParams
        self.lora, self.opt_state = jax.device_put((lora, self.optimizer.init(lora)), replicated)
        self.loss = loss
        self._step = jax.jit(self._update, donate_argnames=("lora", "opt_state"))
        # the base weights are an argument (not constants folded into the program) and get no gradient
        self._logprobs = jax.jit(lambda base_state, lora, ids: token_logprobs(self.graphdef, base_state, lora, ids))

    def _update(self, base_state, lora: LoRAParams, opt_state, batch: dict) -> tuple[LoRAParams, object, jax.Array]:
        def loss_of(params: LoRAParams) -> jax.Array:
            return self.loss(token_logprobs(self.graphdef, base_state, params, batch["input_ids"]), batch)

        value, grads = jax.value_and_grad(loss_of)(lora)
        lora, opt_state, kept = guarded_update(self.optimizer, lora, opt_state, grads, value)
        return lora, opt_state, value, kept

    def step(self, batch: dict[str, np.ndarray]) -> float:
        """One optax update on batch (input_ids [B, S] integer token ids plus what the loss reads); -> the loss
        before it. ValueError for a malformed batch, and for a step whose loss or updated adapter is not finite (then
        the adapter stays as it was: train/step_guard.py)."""
        batch = checked_batch(batch, self.vocab_size)
        self.lora, self.opt_state, value, kept = self._step(self.base_state, self.lora, self.opt_state, batch)
        raise_if_refused(float(value), bool(kept))
        return float(value)

    def token_logprobs(self, input_ids: np.ndarray) -> np.ndarray:
        """input_ids [B, S] -> [B, S-1] log-probabilities of each next token under the current adapter."""
        ids = checked_batch({"input_ids": input_ids}, self.vocab_size)["input_ids"]
        return np.asarray(self._logprobs(self.base_state, self.lora, jnp.asarray(ids)))


def _check_settings(rank: object, lora_alpha: object, dtype: object) -> None:
    """LoRATrainer's arguments, named as the Python API names them."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank <= 0:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float, np.number)):
        raise ValueError(f"lora_alpha must be a number, got {lora_alpha!r}")
    if not math.isfinite(lora_alpha) or lora_alpha < 0:
        raise ValueError(f"lora_alpha must be finite and >= 0, got {lora_alpha!r}")
    try:
        name = jnp.dtype(dtype).name  # "bfloat16", jnp.bfloat16 and np.float32 alike
    except TypeError:
        name = None
    if name not in TRAINABLE_BASE_DTYPES:
        raise ValueError(f"dtype must be one of {TRAINABLE_BASE_DTYPES} (the base weights' type), got {dtype!r}")


TRAINABLE_BASE_DTYPES = ("float32", "bfloat16")
