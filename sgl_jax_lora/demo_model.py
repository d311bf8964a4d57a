"""The embedded demo model: a small Llama-architecture chat model and two LoRA adapters, shipped in the package.

Flow: `python -m sgl_jax_lora.launch` with no --model-path (and the tests) call `demo_model_path()` and
`demo_adapter_paths()`, which copy the shipped files of sgl_jax_lora/demo/weights/ into the cache directory once
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML template; adapters/NAME/ with
adapter_config.json and adapter_model.safetensors) and reuse that copy afterwards. The weights were trained by
scripts/train_demo.py on the embedded corpus (sgl_jax_lora/demo/corpus.py): nothing is trained or downloaded at
start-up. DEMO_VERSION names the cache directory, so a cache written by an older demo is never reused.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the settings sit a layer above: the demo's defaults only read and replace their fields
    from sgl_jax_lora.server_args import ServerArgs

DEMO_VERSION = "v2"
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "weights")
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
ADAPTER_NAMES = ("demo-upper", "demo-pirate")  # answers in upper case; answers in pirate talk
ADAPTERS_SUBDIR = "adapters"

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
    """Path of the demo model directory (its adapters under adapters/NAME), copying the shipped files first if needed."""
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


def demo_adapter_paths(cache_dir: str | None = None) -> dict[str, str]:
    """Name -> PEFT directory of each demo adapter (trained on the demo model), in a fixed order."""
    root = os.path.join(demo_model_path(cache_dir), ADAPTERS_SUBDIR)
    return {name: os.path.join(root, name) for name in ADAPTER_NAMES}


def write_demo_model(out_dir: str, shipped_dir: str = SHIPPED_DIR) -> None:
    """Copy the shipped model files and adapters into out_dir; a missing file names the script that makes it."""
    model_dir = os.path.join(shipped_dir, "model")
    missing = [name for name in MODEL_FILES if not os.path.isfile(os.path.join(model_dir, name))]
    missing += [name for name in ADAPTER_NAMES if not os.path.isdir(os.path.join(shipped_dir, ADAPTERS_SUBDIR, name))]
    if missing:
        raise FileNotFoundError(
            f"the demo model files {missing} are missing from {shipped_dir}; reinstall the package "
            "or run `python scripts/train_demo.py` to rebuild them"
        )
    for name in MODEL_FILES:
        shutil.copy(os.path.join(model_dir, name), os.path.join(out_dir, name))
    shutil.copytree(os.path.join(shipped_dir, ADAPTERS_SUBDIR), os.path.join(out_dir, ADAPTERS_SUBDIR))


def with_demo_defaults(args: ServerArgs) -> tuple[ServerArgs, str]:
    """-> (args, model path): the demo model when no --model-path is given, plus its adapters when neither
    --lora-paths nor --no-enable-lora is given (launch and the offline Engine alike). They are registered like
    --lora-paths (trusted, from the package), so clients still load nothing else unless --lora-allowed-dirs says so.
    ValueError where --served-model-name takes one of those adapters' names."""
    if args.model_path is not None:
        return args, args.model_path
    if args.lora_paths is None and args.enable_lora is not False:
        if args.served_model_name in ADAPTER_NAMES:
            raise ValueError(
                f"--served-model-name '{args.served_model_name}' clashes with the name of one of the demo model's "
                f"adapters ({', '.join(ADAPTER_NAMES)}), served by default; pick another --served-model-name, or pass "
                "--lora-paths (adapters of your own) or --no-enable-lora (none)"
            )
        args = dataclasses.replace(args, lora_paths=[f"{name}={path}" for name, path in demo_adapter_paths().items()])
    return args, demo_model_path()
