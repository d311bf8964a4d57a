"""`python -m sgl_jax_lora.train`: fine-tune a LoRA adapter with optax and write it as a PEFT directory.

Flow: parse flags -> tokenizer (AutoTokenizer of the model directory) -> read_examples (data.py) -> LoRATrainer
(trainer.py) for --steps optax steps under a tqdm bar -> OUT/adapter_config.json + OUT/adapter_model.safetensors
(PEFT names: `PeftModel.from_pretrained(base, OUT)` and `--lora-paths name=OUT` both load it) and the loss curve
OUT/loss.csv (+ OUT/loss.png with matplotlib).

    python -m sgl_jax_lora.train --model-path M --data train.jsonl --output-dir out --rank 8 --steps 100
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import optax
from tqdm import tqdm

from sgl_jax_lora.lora.target_shapes import LORA_TARGET_MODULES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sgl_jax_lora.train", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="HF model directory (config.json, safetensors, tokenizer)")
    parser.add_argument("--data", required=True, help="JSONL: {prompt, completion} or {messages: [...]} per line")
    parser.add_argument("--output-dir", required=True, help="where the PEFT adapter and loss curve are written")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: 2 x rank)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=512, help="examples are truncated to this many tokens")
    parser.add_argument(
        "--target-modules",
        default=",".join(LORA_TARGET_MODULES),
        help=f"comma-separated, among {','.join(LORA_TARGET_MODULES)}",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="base weights' dtype")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps <= 0 or args.batch_size <= 0:
        parser.error("--steps and --batch-size must be positive")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a positive finite number, got {args.lr}")
    if args.alpha is not None and not math.isfinite(args.alpha):
        parser.error(f"--alpha must be a finite number, got {args.alpha}")
    if args.max_len < 2:
        parser.error(f"--max-len must be at least 2 (a prompt token and a completion token), got {args.max_len}")
    return args


def prepare_output_dir(path: str) -> None:
    """Create the output directory and check it takes files, before any training (OSError names the problem)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise OSError(f"--output-dir {path} is a file; name a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise OSError(f"--output-dir {path} cannot take files ({e.strerror}); name a writable directory") from None


def train(args: argparse.Namespace) -> list[float]:
    """Run the training the flags describe; -> the loss of every step."""
    from sgl_jax_lora.managers.tokenizer_files import load_tokenizer
    from sgl_jax_lora.train.curves import save_curve
    from sgl_jax_lora.train.data import batches, padded_length, read_examples
    from sgl_jax_lora.train.lora_params import save_peft_adapter
    from sgl_jax_lora.train.trainer import LoRATrainer

    prepare_output_dir(args.output_dir)
    tokenizer = load_tokenizer(args.model_path, "--model-path")
    try:
        examples = read_examples(args.data, tokenizer, args.max_len)
    except OSError as e:
        raise OSError(f"--data {args.data} cannot be read ({e.strerror}); name a JSONL file of examples") from None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trainer = LoRATrainer(
        args.model_path,
        rank=args.rank,
        lora_alpha=args.alpha if args.alpha is not None else 2.0 * args.rank,
        target_modules=tuple(m.strip() for m in args.target_modules.split(",") if m.strip()),
        optimizer=optax.adamw(args.lr, weight_decay=0.0),
        dtype=args.dtype,
        seed=args.seed,
    )
    stream = batches(examples, args.batch_size, padded_length(examples), pad_id, args.seed)
    losses = []
    with tqdm(range(args.steps), desc="training", unit="step") as bar:
        for _ in bar:
            input_ids, loss_mask = next(stream)
            try:
                losses.append(trainer.step({"input_ids": input_ids, "loss_mask": loss_mask}))
            except ValueError as e:  # a step the trainer refused: a non-finite loss or update (train/step_guard.py)
                started = f" (it started at {losses[0]:.4f})" if losses else ""
                raise ValueError(
                    f"step {len(losses) + 1} failed{started}: {e}; no adapter written: lower --lr, or train in "
                    "float32 (--dtype)"
                ) from None
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    save_peft_adapter(trainer.lora, args.output_dir, os.path.abspath(args.model_path))
    written = save_curve(os.path.join(args.output_dir, "loss"), "loss", losses)
    print(
        f"adapter written to {args.output_dir} ({len(examples)} examples, loss {losses[0]:.4f} -> {losses[-1]:.4f}); "
        f"curve: {', '.join(written)}"
    )
    return losses


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from sgl_jax_lora.utils.quiet import quiet_platform_probes, skip_tpu_probe_without_chips

    quiet_platform_probes()  # before transformers and JAX's devices
    skip_tpu_probe_without_chips()
    try:
        train(args)
    except (ValueError, OSError) as e:  # bad data, a diverged run, an unusable directory: a message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
