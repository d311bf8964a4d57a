"""Write N random PEFT LoRA adapters for a base model, for benchmarks and churn tests.

Sits beside the serving flow: its output is what `--lora-paths` / `/load_lora_adapter` take. Each
adapter directory holds the files `peft`'s save_pretrained writes (`adapter_config.json`,
`adapter_model.safetensors` with `base_model.model.<module>.lora_{A,B}.weight` keys, a README.md),
written with json + safetensors only, so neither torch nor peft is needed here.

    python scripts/make_adapters.py --model /models/llama-3-8b --num-adapters 20 \
        --rank-mix 8,16,32,64 --targets all --out-dir /tmp/adapters
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sgl_jax_lora.lora.target_shapes import LORA_TARGET_MODULES, LoRATargetShapes  # noqa: E402

PEFT_VERSION_WRITTEN = "0.21.2"  # the peft release whose adapter_config.json fields are mirrored below


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="base model directory or its config.json")
    parser.add_argument("--out-dir", required=True, help="adapters go to OUT_DIR/adapter_000, adapter_001, ...")
    parser.add_argument("--num-adapters", type=int, default=1)
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument("--rank", type=int, default=16, help="rank of every adapter")
    ranks.add_argument("--rank-mix", default=None, help="comma-separated ranks, assigned round-robin")
    parser.add_argument("--lora-alpha", type=float, default=None, help="default: 2 * rank")
    parser.add_argument("--use-rslora", action="store_true")
    parser.add_argument(
        "--targets", default="all", help=f"'all' or comma-separated subset of {','.join(LORA_TARGET_MODULES)}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--b-std", type=float, default=0.02, help="std of the random lora_B entries")
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    parser.add_argument(
        "--distinct-weights",
        type=int,
        default=0,
        help="write only this many distinct weight files and hard-link adapter i to file i mod N "
        "(each adapter keeps its own directory and config; saves disk for 1000-adapter runs)",
    )
    return parser.parse_args(argv)


def load_target_shapes(model: str) -> LoRATargetShapes:
    config_path = Path(model) / "config.json" if Path(model).is_dir() else Path(model)
    with open(config_path, encoding="utf-8") as f:
        return LoRATargetShapes.from_hf_config(json.load(f))


def parse_targets(targets: str) -> list[str]:
    if targets == "all":
        return list(LORA_TARGET_MODULES)
    names = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in LORA_TARGET_MODULES]
    if unknown or not names:
        raise SystemExit(f"--targets {targets!r}: unknown {unknown}; choose from {', '.join(LORA_TARGET_MODULES)}")
    return names


def adapter_config_dict(rank: int, alpha: float, targets: list[str], base_model: str, use_rslora: bool) -> dict:
    """adapter_config.json with the fields (and defaults) of peft's LoraConfig."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_model,
        "bias": "none",
        "corda_config": None,
        "eva_config": None,
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": alpha,
        "lora_bias": False,
        "lora_dropout": 0.0,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "peft_version": PEFT_VERSION_WRITTEN,
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(targets),
        "target_parameters": None,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": None,
        "use_dora": False,
        "use_rslora": use_rslora,
    }


def random_lora_tensors(
    shapes: LoRATargetShapes, rank: int, targets: list[str], rng: np.random.Generator, b_std: float, dtype: str
) -> dict[str, np.ndarray]:
    """PEFT-named tensors: A [r, in] ~ U(+-1/sqrt(in)), B [out, r] ~ N(0, b_std), both non-zero."""
    tensors = {}
    for _layer, module, path in shapes.all_module_paths():
        if module not in targets:
            continue
        in_features, out_features = shapes.module_shapes[module]
        bound = 1.0 / np.sqrt(in_features)
        prefix = f"base_model.model.{path}"
        uniform = rng.random((rank, in_features), dtype=np.float32)
        tensors[f"{prefix}.lora_A.weight"] = ((2 * uniform - 1) * bound).astype(dtype)
        tensors[f"{prefix}.lora_B.weight"] = (
            rng.standard_normal((out_features, rank), dtype=np.float32) * b_std
        ).astype(dtype)
    return tensors


def write_adapter(
    out_dir: Path, config: dict, tensors: dict[str, np.ndarray] | None, link_weights_from: Path | None = None
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "adapter_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    weights = out_dir / "adapter_model.safetensors"
    if link_weights_from is not None:
        weights.unlink(missing_ok=True)
        os.link(link_weights_from / "adapter_model.safetensors", weights)
    else:
        save_file(tensors, str(weights), metadata={"format": "pt"})
    (out_dir / "README.md").write_text(
        f"---\nbase_model: {config['base_model_name_or_path']}\nlibrary_name: peft\n---\n\n"
        f"Random LoRA adapter (r={config['r']}, lora_alpha={config['lora_alpha']}) written by "
        "scripts/make_adapters.py for testing and benchmarks; it carries no learned behavior.\n"
    )


def main(argv: list[str] | None = None) -> list[Path]:
    args = parse_args(argv)
    shapes = load_target_shapes(args.model)
    targets = parse_targets(args.targets)
    rank_mix = [int(r) for r in args.rank_mix.split(",")] if args.rank_mix else [args.rank]
    if any(r <= 0 for r in rank_mix):
        raise SystemExit(f"ranks must be positive, got {rank_mix}")
    base_model = os.path.abspath(args.model if Path(args.model).is_dir() else os.path.dirname(args.model))
    rng = np.random.default_rng(args.seed)
    written = []
    width = max(3, len(str(args.num_adapters - 1)))
    for i in range(args.num_adapters):
        rank = rank_mix[i % len(rank_mix)]
        alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * rank
        out_dir = Path(args.out_dir) / f"adapter_{i:0{width}d}"
        config = adapter_config_dict(rank, alpha, targets, base_model, args.use_rslora)
        if args.distinct_weights and i >= args.distinct_weights:
            source = written[i % args.distinct_weights]
            if rank_mix[i % len(rank_mix)] != rank_mix[(i % args.distinct_weights) % len(rank_mix)]:
                raise SystemExit("--distinct-weights must be a multiple of the --rank-mix length")
            write_adapter(out_dir, config, None, link_weights_from=source)
        else:
            write_adapter(out_dir, config, random_lora_tensors(shapes, rank, targets, rng, args.b_std, args.dtype))
        written.append(out_dir)
        print(f"{out_dir}  r={rank} lora_alpha={alpha:g} targets={','.join(targets)}")
    return written


def named_adapters_beside(model_dir: str, num_adapters: int, *options: str) -> list[str]:
    """num_adapters rank-16 adapters for every target module, written under MODEL_DIR/adapters (more
    make_adapters options after them); -> their `--lora-paths` specs, a0=DIR, a1=DIR, ... (what the benchmarks
    name requests by)."""
    out_dir = os.path.join(model_dir, "adapters")
    argv = ["--model", model_dir, "--out-dir", out_dir, "--num-adapters", str(num_adapters), "--rank", "16", *options]
    return [f"a{i}={path}" for i, path in enumerate(main(argv))]


if __name__ == "__main__":
    main()
