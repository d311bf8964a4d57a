"""FullTrainer: optax updates of every weight of the serving model (full-parameter training, no adapter).

Flow: FullTrainer(model_path, ...) loads the model as the engine does (models/weight_loader.py, no LoRA buffers, one
device) -> `step(batch)` runs one jitted optax update of the whole weight state; the loss is the same function of the
training forward's per-token log-probabilities (forward.py, called with an empty adapter) that LoRATrainer uses ->
`hf_tensors()` turns the trained state back into HF tensor names and layouts, so `save(out_dir)` writes a
model.safetensors that HF transformers and our weight loader both read. scripts/train_demo.py trains the demo model
with it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import save_file

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.models.weight_loader import load_model_state
from sgl_jax_lora.train.forward import token_logprobs
from sgl_jax_lora.train.lora_params import LoRAParams
from sgl_jax_lora.train.step_guard import checked_batch, guarded_update, raise_if_refused
from sgl_jax_lora.train.trainer import Loss, sft_loss

NO_ADAPTER = LoRAParams(weights={}, scaling=0.0, rank=0, lora_alpha=0.0)


class FullTrainer:
    def __init__(self, model_path: str, optimizer: optax.GradientTransformation, loss: Loss = sft_loss):
        """The model directory's weights (e.g. a freshly initialized checkpoint) are the starting point."""
        self.cfg = ModelConfig.from_model_path(model_path)
        mesh = make_mesh(1)
        self.graphdef, state = load_model_state(self.cfg, 1, 1, jnp.float32, mesh, lora=None)
        self.optimizer, self.loss = optimizer, loss
        # placed as the update returns them, so that the second step finds the first step's program
        self.state, self.opt_state = jax.device_put(
            (state, optimizer.init(state)), NamedSharding(mesh, PartitionSpec())
        )
        self._step = jax.jit(self._update, donate_argnames=("state", "opt_state"))

    def _update(self, state: nnx.State, opt_state, batch: dict) -> tuple[nnx.State, object, jax.Array]:
        def loss_of(params: nnx.State) -> jax.Array:
            return self.loss(
                token_logprobs(self.graphdef, params, NO_ADAPTER, batch["input_ids"], frozen_base=False), batch
            )

        value, grads = jax.value_and_grad(loss_of)(state)
        state, opt_state, kept = guarded_update(self.optimizer, state, opt_state, grads, value)
        return state, opt_state, value, kept

    def step(self, batch: dict[str, np.ndarray]) -> float:
        """One optax update on batch (input_ids [B, S] integer token ids plus what the loss reads); -> the loss
        before it. A malformed batch, or a step whose loss or weights turn non-finite, raise ValueError (the weights
        stay as they were: train/step_guard.py)."""
        batch = checked_batch(batch, self.cfg.vocab_size)
        self.state, self.opt_state, value, kept = self._step(self.state, self.opt_state, batch)
        raise_if_refused(float(value), bool(kept))
        return float(value)

    def hf_tensors(self) -> dict[str, np.ndarray]:
        """HF name -> float32 array ([out, in] linears, q/k/v and gate/up unpacked): what save_pretrained writes."""
        flat = {
            tuple(str(p) for p in path): np.asarray(v.get_value(), np.float32)
            for path, v in nnx.to_flat_state(self.state)
        }
        tensors = {
            "model.embed_tokens.weight": flat[("embed_tokens", "embedding")],
            "model.norm.weight": flat[("norm", "scale")],
        }
        if ("lm_head", "kernel") in flat:
            tensors["lm_head.weight"] = np.ascontiguousarray(flat[("lm_head", "kernel")].T)
        cfg = self.cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for layer in range(cfg.num_layers):
            get = lambda module, leaf, layer=layer: flat[("layers", module, leaf)][layer]  # noqa: E731
            q, k, v = np.split(get("qkv_proj", "kernel"), [q_size, q_size + kv_size], axis=1)
            gate, up = np.split(get("gate_up_proj", "kernel"), 2, axis=1)
            prefix = f"model.layers.{layer}."
            for name, kernel in (
                ("self_attn.q_proj", q),
                ("self_attn.k_proj", k),
                ("self_attn.v_proj", v),
                ("self_attn.o_proj", get("o_proj", "kernel")),
                ("mlp.gate_proj", gate),
                ("mlp.up_proj", up),
                ("mlp.down_proj", get("down_proj", "kernel")),
            ):
                tensors[f"{prefix}{name}.weight"] = np.ascontiguousarray(kernel.T)
            tensors[prefix + "input_layernorm.weight"] = get("input_layernorm", "scale")
            tensors[prefix + "post_attention_layernorm.weight"] = get("post_attention_layernorm", "scale")
        return tensors

    def save(self, out_dir: str) -> str:
        """Write out_dir/model.safetensors (float32, HF names); -> its path."""
        path = os.path.join(out_dir, "model.safetensors")
        save_file(self.hf_tensors(), path, metadata={"format": "pt"})
        return path
