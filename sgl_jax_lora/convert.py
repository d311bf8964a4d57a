"""`python -m sgl_jax_lora.convert`: turn an HF model directory into a converted checkpoint that starts faster.

Flow: parse flags -> ModelConfig of the HF directory -> load_model_state (weight_loader.py: the same transposes,
shard-major q/k/v and gate/up packing, kv-head replication and cast the server does at every start) on host CPU
devices, one per tensor shard -> OUT/config.json and tokenizer files copied -> save_converted
(models/orbax_checkpoint.py) writes OUT/weights/ with orbax, then the metadata file. `--model-path OUT` then
restores the weights straight into the mesh (docs/checkpoints.md).

    python -m sgl_jax_lora.convert --model-path /models/Llama-3-8B --output-dir /models/Llama-3-8B-tp4 --tp-size 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from sgl_jax_lora.server_args import DTYPES

# Files of an HF directory that hold weights; everything else at its top level (config, tokenizer, generation
# config, chat template, license) is copied beside the converted weights.
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sgl_jax_lora.convert", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model-path", required=True, help="HF model directory (config.json, *.safetensors, tokenizer)"
    )
    parser.add_argument(
        "--output-dir", required=True, help="new directory for the converted checkpoint (must not exist or be empty)"
    )
    parser.add_argument(
        "--tp-size", type=int, default=1, help="tensor-parallel size the checkpoint will be served with"
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=DTYPES,
        help="serving dtype the weights are cast to (the server's --dtype)",
    )
    args = parser.parse_args(argv)
    if args.tp_size < 1:
        parser.error(f"--tp-size must be a positive integer, got {args.tp_size}")
    return args


def copy_side_files(model_path: str, output_dir: str) -> list[str]:
    """Copy config.json, the tokenizer and the other non-weight top-level files; -> their names."""
    copied = []
    for name in sorted(os.listdir(model_path)):
        source = os.path.join(model_path, name)
        if os.path.isfile(source) and not name.endswith(WEIGHT_FILE_SUFFIXES):
            shutil.copy2(source, os.path.join(output_dir, name))
            copied.append(name)
    return copied


def convert(model_path: str, output_dir: str, tp_size: int = 1, dtype: str = "bfloat16") -> str:
    """Write the converted checkpoint of the HF directory `model_path` to `output_dir`; -> output_dir."""
    import jax
    import jax.numpy as jnp

    from sgl_jax_lora.configs.model_config import ModelConfig, ModelConfigError
    from sgl_jax_lora.layers.sharding import make_mesh
    from sgl_jax_lora.models.orbax_checkpoint import is_converted_checkpoint, save_converted
    from sgl_jax_lora.models.weight_loader import load_model_state

    cfg = ModelConfig.from_model_path(model_path)
    if is_converted_checkpoint(model_path):
        raise ModelConfigError(
            f"'{model_path}' is already a converted checkpoint; pass the HF directory it came from as --model-path"
        )
    cfg.check_tensor_parallel(tp_size)
    if os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
        raise ModelConfigError(
            f"--output-dir '{output_dir}' exists and is not an empty directory; choose a new one (nothing is overwritten)"
        )
    cpus = jax.devices("cpu")
    # One host device per tensor shard: orbax then writes each shard as its own chunk, so a serving process
    # reads only the chunks of its shards. With fewer devices the arrays are whole chunks (same values).
    mesh = make_mesh(tp_size if len(cpus) >= tp_size else 1, cpus)
    # The parameters do not depend on the page size; 16 is the server's default.
    _, state = load_model_state(cfg, tp_size, 16, jnp.dtype(dtype), mesh, lora=None)
    os.makedirs(output_dir, exist_ok=True)
    copy_side_files(model_path, output_dir)
    save_converted(state, output_dir, jnp.dtype(dtype).name, tp_size, cfg.architecture, os.path.abspath(model_path))
    return output_dir


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Conversion is host work: keep JAX off any accelerator, and give it one CPU device per tensor shard.
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.tp_size}".strip()
    from safetensors import SafetensorError

    from sgl_jax_lora.configs.model_config import ModelConfigError

    start = time.perf_counter()
    try:
        convert(args.model_path, args.output_dir, args.tp_size, args.dtype)
    except (ModelConfigError, OSError, SafetensorError) as e:  # a model file or the output directory: no traceback
        sys.exit(f"error: {type(e).__name__}: {e}" if not isinstance(e, ModelConfigError) else f"error: {e}")
    except KeyboardInterrupt:  # the metadata file is written last: what was written is known as unfinished
        print(f"interrupted: {args.output_dir} is incomplete (not servable); remove it", file=sys.stderr)
        sys.exit(130)
    print(
        f"wrote {args.output_dir} ({args.dtype}, tp {args.tp_size}) in {time.perf_counter() - start:.1f} s; serve it with\n"
        f"  python -m sgl_jax_lora.launch --model-path {args.output_dir} --tp-size {args.tp_size} --dtype {args.dtype}"
    )


if __name__ == "__main__":
    main()
