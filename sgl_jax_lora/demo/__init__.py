"""The demo bundle: the embedded chat corpus (corpus.py) and, under weights/, the base model and two LoRA adapters
trained on it by scripts/train_demo.py. sgl_jax_lora/demo_model.py turns these shipped files into the model
directory the engine serves by default.
"""
