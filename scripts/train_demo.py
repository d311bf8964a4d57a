"""Rebuild the shipped demo: train the demo model and its two LoRA adapters on the embedded corpus (CPU, fixed seeds).

Flow: the tokenizer (sgl_jax_lora/demo/tokenizer.py) is trained on the corpus (sgl_jax_lora/demo/corpus.py) ->
config.json + seeded random weights -> FullTrainer (sgl_jax_lora/train/full_trainer.py) trains every weight on the
corpus' chat exchanges, plain and restyled on a system message's request (loss on the answers) -> LoRATrainer (sgl_jax_lora/train/trainer.py) trains each adapter of
ADAPTER_STYLES on the same questions with restyled answers -> OUT/model/ (what demo_model.py ships) and
OUT/adapters/NAME/ (PEFT directories). After each stage it prints how many corpus questions the model answers exactly
under greedy decoding.

    python scripts/train_demo.py                                  # writes sgl_jax_lora/demo/weights/
    python scripts/train_demo.py --out-dir /tmp/demo --base-steps 2 --adapter-steps 2 --eval-questions 2  # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sgl_jax_lora.demo.corpus import ADAPTER_STYLES, base_exchanges, base_records, chat_records  # noqa: E402
from sgl_jax_lora.demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, write_tokenizer  # noqa: E402
from sgl_jax_lora.demo_model import ADAPTERS_SUBDIR, DEMO_CONFIG, SHIPPED_DIR  # noqa: E402
from sgl_jax_lora.train.data import batches, examples_from_records, padded_length  # noqa: E402
from sgl_jax_lora.train.forward import forward_logits  # noqa: E402
from sgl_jax_lora.train.full_trainer import NO_ADAPTER, FullTrainer  # noqa: E402
from sgl_jax_lora.train.lora_params import save_peft_adapter  # noqa: E402
from sgl_jax_lora.train.trainer import LoRATrainer  # noqa: E402

BASE_MODEL_NAME = "sgl_jax_lora demo model"  # adapter_config.json's base_model_name_or_path


def initial_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Seeded random HF-named weights (normal, std 0.05; norm scales 1): the starting point of training."""
    rng = np.random.default_rng(seed)
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv_heads, head_dim, vocab = config["num_key_value_heads"], config["head_dim"], config["vocab_size"]
    normal = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    weights = {
        "model.embed_tokens.weight": normal(vocab, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": normal(vocab, hidden),
    }
    shapes = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    for i in range(config["num_hidden_layers"]):
        weights[f"model.layers.{i}.input_layernorm.weight"] = np.ones(hidden, np.float32)
        weights[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        for name, shape in shapes.items():
            weights[f"model.layers.{i}.{name}.weight"] = normal(*shape)
    return weights


def write_initial_model(model_dir: str, seed: int) -> None:
    from safetensors.numpy import save_file

    os.makedirs(model_dir, exist_ok=True)
    vocab_size = write_tokenizer(model_dir, DEMO_CONFIG["max_position_embeddings"])
    config = dict(DEMO_CONFIG, vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(initial_weights(config, seed), os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})


def schedule(peak_lr: float, steps: int) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, peak_lr, max(1, min(100, steps // 10)), max(2, steps), peak_lr / 20)


def greedy_answers(graphdef, state, lora, tokenizer, questions: list[str], max_new_tokens: int = 40) -> list[str]:
    """Greedy replies with the training forward (no KV cache: the whole right-padded batch each token)."""
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    lengths = np.array([len(e) for e in encoded])
    ids = np.full((len(encoded), -(-(lengths.max() + max_new_tokens) // 16) * 16), PAD_ID, np.int32)
    for row, e in enumerate(encoded):
        ids[row, : len(e)] = e
    logits_of = jax.jit(lambda s, a, x: forward_logits(graphdef, s, a, x))
    rows = np.arange(len(encoded))
    for step in range(max_new_tokens):
        logits = np.asarray(logits_of(state, lora, jnp.asarray(ids)))
        ids[rows, lengths + step] = logits[rows, lengths + step - 1].argmax(-1)
    eos = tokenizer.eos_token_id
    replies = []
    for row, length in enumerate(lengths):
        generated = ids[row, length : length + max_new_tokens].tolist()
        replies.append(tokenizer.decode(generated[: generated.index(eos)] if eos in generated else generated))
    return replies


def exact_matches(replies: list[str], expected: list[str]) -> int:
    return sum(r == e for r, e in zip(replies, expected))


def train_steps(trainer, examples, steps: int, batch_size: int, seed: int, label: str) -> list[float]:
    stream = batches(examples, batch_size, padded_length(examples), PAD_ID, seed)
    losses, start = [], time.monotonic()
    for step in range(steps):
        input_ids, loss_mask = next(stream)
        losses.append(trainer.step({"input_ids": input_ids, "loss_mask": loss_mask}))
        if (step + 1) % 250 == 0 or step + 1 == steps:
            print(
                f"{label}: step {step + 1}/{steps} loss {losses[-1]:.4f} ({time.monotonic() - start:.0f} s)", flush=True
            )
    return losses


def train_base(model_dir: str, tokenizer, args: argparse.Namespace) -> None:
    examples = examples_from_records(base_records(), tokenizer, 128, "demo corpus")
    trainer = FullTrainer(model_dir, optax.adamw(schedule(args.base_lr, args.base_steps), weight_decay=0.0))
    train_steps(trainer, examples, args.base_steps, args.batch_size, args.seed, "base")
    trainer.save(model_dir)
    questions, answers = zip(*base_exchanges()[: args.eval_questions])
    replies = greedy_answers(trainer.graphdef, trainer.state, NO_ADAPTER, tokenizer, list(questions))
    print(
        f"base: {exact_matches(replies, list(answers))}/{len(answers)} corpus answers exact; "
        f"'{questions[0]}' -> '{replies[0]}'",
        flush=True,
    )


def train_adapter(name: str, model_dir: str, out_dir: str, tokenizer, args: argparse.Namespace) -> None:
    style = ADAPTER_STYLES[name]
    examples = examples_from_records(chat_records(style), tokenizer, 128, f"{name} corpus")
    trainer = LoRATrainer(
        model_dir,
        rank=args.rank,
        lora_alpha=2.0 * args.rank,
        seed=args.seed,
        optimizer=optax.adamw(schedule(args.adapter_lr, args.adapter_steps), weight_decay=0.0),
    )
    train_steps(trainer, examples, args.adapter_steps, args.batch_size, args.seed, name)
    save_peft_adapter(trainer.lora, out_dir, BASE_MODEL_NAME)
    questions, answers = zip(*base_exchanges()[: args.eval_questions])
    replies = greedy_answers(trainer.graphdef, trainer.base_state, trainer.lora, tokenizer, list(questions))
    print(
        f"{name}: {exact_matches(replies, [style(a) for a in answers])}/{len(answers)} corpus answers exact; "
        f"'{questions[0]}' -> '{replies[0]}'",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default=SHIPPED_DIR, help="writes OUT/model/ and OUT/adapters/NAME/")
    parser.add_argument("--base-steps", type=int, default=1200)
    parser.add_argument("--adapter-steps", type=int, default=400)
    parser.add_argument("--base-lr", type=float, default=3e-3)
    parser.add_argument("--adapter-lr", type=float, default=1e-2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapters-only", action="store_true", help="keep OUT/model/ as it is; retrain the adapters")
    parser.add_argument(
        "--eval-questions", type=int, default=None, help="corpus questions checked after each stage (default: all)"
    )
    args = parser.parse_args(argv)
    if min(args.base_steps, args.adapter_steps, args.batch_size, args.rank) < 1:
        parser.error("--base-steps, --adapter-steps, --batch-size and --rank must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    model_dir = os.path.join(args.out_dir, "model")
    if not args.adapters_only:
        write_initial_model(model_dir, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if not args.adapters_only:
        train_base(model_dir, tokenizer, args)
    for name in ADAPTER_STYLES:
        train_adapter(name, model_dir, os.path.join(args.out_dir, ADAPTERS_SUBDIR, name), tokenizer, args)
    print(f"demo written to {args.out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
