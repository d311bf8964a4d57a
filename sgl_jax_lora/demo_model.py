"""The embedded demo model: a small Llama-architecture HF directory written deterministically on first use.

Flow: `python -m sgl_jax_lora.launch` with no --model-path, and the tests, call `demo_model_path()`, which
writes (once, then reuses from the cache directory) config.json, model.safetensors (seeded random
weights), a byte-level BPE tokenizer.json trained with the `tokenizers` library on an embedded corpus,
and a tokenizer_config.json carrying a ChatML-style chat template. No download is ever needed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
from safetensors.numpy import save_file

DEMO_VERSION = "v1"
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = """The quick brown fox jumps over the lazy dog. A serving engine answers many requests at once.
JAX compiles programs for accelerators; one base model serves many low-rank adapters in every batch.
Hello, world! What is the capital of France? Paris is the capital of France. Numbers: 0 1 2 3 4 5 6 7 8 9.
Tell me a story about a robot who learns to paint. Once upon a time there was a small robot.
def add(a, b): return a + b  # code, punctuation, (brackets) [lists] {dicts} and "quotes".
"""

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def default_cache_dir() -> str:
    root = os.environ.get("SGL_JAX_LORA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sgl_jax_lora")
    return os.path.join(root, f"demo-model-{DEMO_VERSION}")


def demo_model_path(cache_dir: str | None = None) -> str:
    """Path of the demo model directory, writing it first if it is not there yet."""
    target = cache_dir or default_cache_dir()
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix="demo-model-", dir=os.path.dirname(target))
    try:
        write_demo_model(staging)
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process won the race; use its copy
        if not os.path.isfile(os.path.join(target, "model.safetensors")):
            raise
    return target


def write_demo_model(out_dir: str) -> None:
    vocab_size = _write_tokenizer(out_dir)
    config = dict(DEMO_CONFIG, vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=4)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(_random_weights(config), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def _write_tokenizer(out_dir: str) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "model_max_length": DEMO_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    return tokenizer.get_vocab_size()


def _random_weights(config: dict) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv_heads, head_dim, vocab = config["num_key_value_heads"], config["head_dim"], config["vocab_size"]
    normal = lambda *shape: (rng.standard_normal(shape) * 0.08).astype(np.float32)  # noqa: E731
    weights = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
    weights["lm_head.weight"] = normal(vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "input_layernorm.weight": np.ones(hidden, np.float32),
                p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": normal(inter, hidden),
                p + "mlp.up_proj.weight": normal(inter, hidden),
                p + "mlp.down_proj.weight": normal(hidden, inter),
            }
        )
    return weights
