"""LoRA fine-tuning with optax on the serving model's own Flax NNX weights (CLI: `python -m sgl_jax_lora.train`).

Flow: data.py (JSONL -> padded batches) -> trainer.py (LoRATrainer: jitted optax steps) over forward.py (the model
without a paged cache, LoRA A/B as the only trainable pytree) -> lora_params.py (PEFT tensors and config, written to
a directory or pushed to a running engine with Engine.update_lora_adapter).
"""
