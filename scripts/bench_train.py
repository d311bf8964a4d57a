"""LoRA fine-tuning throughput: sgl_jax_lora.train (JAX) against HF transformers + PEFT (torch), same shapes.

Both sides train a rank-R adapter on all 7 projections of a Llama-3-8B-shaped model with random bf16 base weights
(float32 LoRA A/B, AdamW on the adapter only), on one fixed batch [B, S] with the loss on every token. Each side
runs in its own subprocess, torch first, so neither holds device memory while the other runs.

    python scripts/bench_train.py --out train.json [--num-layers 32 --batch-size 4 --seq-len 512 --steps 10]
    python scripts/bench_train.py --tiny --steps 2 --warmup 1 --frameworks jax   # CPU smoke run, demo-model shapes

Reports tokens/s (B * S per optimizer step, over --steps timed steps after --warmup) and peak device memory
(JAX: device.memory_stats()["peak_bytes_in_use"]; torch: torch.cuda.max_memory_allocated()).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_offline import LLAMA3_8B, make_model_dir  # noqa: E402

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY = {
    **LLAMA3_8B,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 491,
}


def model_config(opts: argparse.Namespace) -> dict:
    return {**(TINY if opts.tiny else LLAMA3_8B), "num_hidden_layers": opts.num_layers}


def fixed_batch(opts: argparse.Namespace, vocab_size: int) -> np.ndarray:
    """input_ids [B, S] int32, the same on both sides."""
    return np.random.default_rng(0).integers(0, vocab_size, size=(opts.batch_size, opts.seq_len), dtype=np.int32)


def run_jax(opts: argparse.Namespace) -> dict:
    import jax

    from sgl_jax_lora.train.trainer import LoRATrainer

    cfg = model_config(opts)
    model_dir = make_model_dir(cfg)
    trainer = LoRATrainer(
        model_dir,
        rank=opts.rank,
        lora_alpha=2.0 * opts.rank,
        target_modules=MODULES,
        dtype="bfloat16",
        load_format="dummy",
    )
    ids = fixed_batch(opts, cfg["vocab_size"])
    batch = {"input_ids": ids, "loss_mask": np.ones(ids.shape, np.float32)}
    device = jax.devices()[0]
    resident = (device.memory_stats() or {}).get("bytes_in_use")
    for _ in range(opts.warmup):
        trainer.step(batch)  # float(loss): waits for the step
    start = time.perf_counter()
    losses = [trainer.step(batch) for _ in range(opts.steps)]
    elapsed = time.perf_counter() - start
    stats = device.memory_stats() or {}
    compiled = trainer._step.lower(trainer.base_state, trainer.lora, trainer.opt_state, batch).compile()  # cached
    temp = compiled.memory_analysis().temp_size_in_bytes
    return {
        "framework": f"jax {jax.__version__}",
        "device": str(device.device_kind),
        "step_ms": 1e3 * elapsed / opts.steps,
        "tokens_per_s": ids.size * opts.steps / elapsed,
        "peak_device_bytes": stats.get("peak_bytes_in_use"),
        "resident_bytes_before_steps": resident,
        "step_temp_bytes": temp,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def run_torch(opts: argparse.Namespace) -> dict:
    import peft
    import torch
    import transformers

    cfg = model_config(opts)
    config = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # random init straight into bf16: no float32 copy of the base weights
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    lora = peft.LoraConfig(r=opts.rank, lora_alpha=2 * opts.rank, lora_dropout=0.0, target_modules=list(MODULES))
    model = peft.get_peft_model(model, lora)  # adapter weights in float32 (PEFT's autocast_adapter_dtype)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    ids = torch.from_numpy(fixed_batch(opts, cfg["vocab_size"]).astype(np.int64)).to(device)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss  # mean over all B * (S-1) next-token predictions
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # waits for the step

    for _ in range(opts.warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    losses = [step() for _ in range(opts.steps)]
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lora_dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    return {
        "framework": f"torch {torch.__version__} + transformers {transformers.__version__} + peft {peft.__version__}",
        "device": name,
        "lora_dtypes": lora_dtypes,
        "step_ms": 1e3 * elapsed / opts.steps,
        "tokens_per_s": ids.numel() * opts.steps / elapsed,
        "peak_device_bytes": peak,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def run_in_subprocess(framework: str, argv: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--only", framework, "--result-file", result_path]
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        return {"framework": framework, "error": f"exit code {proc.returncode} (see the output above)"}
    with open(result_path) as f:
        return json.load(f)


def print_table(rows: list[dict], opts: argparse.Namespace) -> None:
    print(
        f"\nLoRA r={opts.rank} on {len(MODULES)} projections, {opts.num_layers} layers{' (tiny dims)' if opts.tiny else ''}, "
        f"batch {opts.batch_size} x {opts.seq_len} tokens, bf16 base, {opts.steps} timed steps after {opts.warmup} warmup"
    )
    print(f"{'framework':<58} {'step ms':>9} {'tokens/s':>10} {'peak GiB':>9} {'loss first->last':>18}")
    gib = lambda b: f"{b / 2**30:.2f}" if b else "n/a"  # noqa: E731
    for row in rows:
        if "error" in row:
            print(f"{row['framework']:<58} {row['error']}")
            continue
        losses = f"{row['first_loss']:.3f}->{row['last_loss']:.3f}"
        print(
            f"{row['framework']:<58} {row['step_ms']:>9.1f} {row['tokens_per_s']:>10.0f} {gib(row['peak_device_bytes']):>9} {losses:>18}"
        )
        if "step_temp_bytes" in row:
            print(
                f"  jax: {gib(row['resident_bytes_before_steps'])} GiB resident before the steps (weights, adapter, optimizer "
                f"state) + {gib(row['step_temp_bytes'])} GiB temporaries of the compiled step"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument(
        "--tiny", action="store_true", help="demo-model widths (hidden 64, vocab 491) for a CPU smoke run"
    )
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--frameworks", nargs="+", default=["torch", "jax"], choices=["torch", "jax"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", choices=["torch", "jax"], help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.only:
        result = run_jax(opts) if opts.only == "jax" else run_torch(opts)
        with open(opts.result_file, "w") as f:
            json.dump(result, f)
        return
    argv = [a for a in sys.argv[1:]]
    rows = [run_in_subprocess(framework, argv) for framework in opts.frameworks]
    print_table(rows, opts)
    if opts.out:
        config = {k: v for k, v in vars(opts).items() if k not in ("only", "result_file", "out")}
        with open(opts.out, "w") as f:
            json.dump({"config": config, "model": model_config(opts), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
